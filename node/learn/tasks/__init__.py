"""Built-in tasks and the task loader."""

from murmur.node.learn.tasks.charlm import CharLMTask
from murmur.node.learn.tasks.digits import DigitsTask
from murmur.node.learn.tasks.task import Batch, Metric, Task, UnknownTask, load_task

BUILTIN_TASKS = {"digits": DigitsTask, "charlm": CharLMTask}

__all__ = ["BUILTIN_TASKS", "Batch", "CharLMTask", "DigitsTask", "Metric", "Task", "UnknownTask", "load_task"]
