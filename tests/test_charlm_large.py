"""The `charlm-large` task: charlm's corpus and layout at >= 2M parameters, deterministic, trains sanely."""

import hashlib
import math

import torch

from murmur.node.learn.tasks import BUILTIN_TASKS, CharLMLargeTask, CharLMTask, load_task
from murmur.node.learn.tasks.charlm import GPT


def _fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_it_is_a_registered_nanogpt_of_at_least_two_million_parameters() -> None:
    task = load_task("charlm-large")
    assert isinstance(task, CharLMLargeTask) and BUILTIN_TASKS["charlm-large"] is CharLMLargeTask
    assert task.name == "charlm-large" and task.metric.name == "loss" and not task.metric.higher_is_better
    model = task.build_model()
    assert isinstance(model, GPT)  # charlm's classes, nanoGPT's layout: only the config differs
    assert sum(p.numel() for p in model.parameters()) >= 2_000_000
    assert (model.cfg.n_layer, model.cfg.block_size) == (4, 64)


def test_it_reads_the_same_bytes_with_the_same_vocabulary_as_charlm() -> None:
    large, small = CharLMLargeTask(), CharLMTask()
    assert large.cfg.vocab_size == small.cfg.vocab_size == 256
    assert torch.equal(large._train, small._train)  # the same training stream
    x, y = next(large.train_batches(3))
    assert (x.shape, y.shape, x.dtype) == ((32, 64), (32, 64), torch.int64)
    assert torch.equal(x[:, 1:], y[:, :-1]) and 0 <= x.min() and x.max() < 256
    # Windows are cut from the training stream itself: the first batch's rows occur in it verbatim.
    stream = bytes(large._train.tolist())
    assert all(bytes(row.tolist()) in stream for row in x[:2])


def test_the_model_is_built_identically_every_time_without_touching_the_callers_rng() -> None:
    task = CharLMLargeTask()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = _fingerprint(task.build_model())
    assert torch.equal(torch.rand(1), before)  # build_model forks the RNG
    assert _fingerprint(CharLMLargeTask().build_model()) == first
    assert first != _fingerprint(CharLMTask().build_model())


def test_one_step_is_finite_and_starts_from_a_uniform_guess() -> None:
    torch.set_num_threads(1)
    task = CharLMLargeTask()
    model = task.build_model()
    optimizer = task.make_optimizer(model)
    batch = next(task.train_batches(0))
    loss = task.loss(model, batch)
    assert abs(loss.item() - math.log(256)) < 0.3  # an untrained model guesses about uniformly over bytes
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    after = task.loss(model, batch).item()
    assert math.isfinite(after) and after < loss.item()  # one AdamW step on the same batch lowers its loss
    held_out = task.evaluate(model)
    assert math.isfinite(held_out["loss"]) and held_out["bits_per_byte"] == held_out["loss"] / math.log(2)
