"""Built-in tasks and the task loader."""

from murmur.node.learn.tasks.charlm import CharLMTask
from murmur.node.learn.tasks.charlm_large import CharLMLargeTask
from murmur.node.learn.tasks.digits import DigitsTask
from murmur.node.learn.tasks.task import Batch, Metric, Task, UnknownTask, check_task_name, load_task

BUILTIN_TASKS = {"digits": DigitsTask, "charlm": CharLMTask, "charlm-large": CharLMLargeTask}

__all__ = ["BUILTIN_TASKS", "Batch", "CharLMLargeTask", "CharLMTask", "DigitsTask", "Metric", "Task", "UnknownTask", "check_task_name",
           "load_task"]
