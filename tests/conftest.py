import logging
import os
import signal
from collections.abc import Iterator

import pytest
from hypothesis import settings

# wandb is installed for the tracking tests: none may reach W&B's servers, and every process a test starts inherits this.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"

# Hypothesis's default 200 ms deadline per example is a timed assert: on a loaded 2-core machine
# a torch example can take longer and fail for no fault of the code. Properties, not speed, are tested.
settings.register_profile("murmur", deadline=None)
settings.load_profile("murmur")


@pytest.fixture
def anyio_backend() -> str:
    # py-libp2p is Trio-native; every async test runs on AnyIO's Trio backend.
    return "trio"


@pytest.fixture(autouse=True)
def _quiet_libp2p() -> None:
    for name in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


@pytest.fixture(autouse=True)
def _stop_signals_restored() -> Iterator[None]:
    """Put SIGTERM's and SIGINT's handlers back after each test: a command run in-process (`murmur`'s `main`)
    leaves them ignored on purpose, and every process a later test started would inherit that."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


@pytest.fixture(autouse=True)
def _registries_restored() -> Iterator[None]:
    """Put the product's registries back after each test: the lab's plugins (`lab.plugins.register`) stay out of other tests."""
    from murmur.node.learn.rules import MERGES, OPTIMIZER_STATE
    from murmur.node.net.partners import PARTNER_CHOICES

    registries = (PARTNER_CHOICES, OPTIMIZER_STATE, MERGES)
    saved = [dict(r) for r in registries]
    yield
    for registry, before in zip(registries, saved, strict=True):
        registry.clear()
        registry.update(before)  # type: ignore[attr-defined]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with slow tests run first, each file's tests in their order: the workers (one file each, `--dist loadfile`)
    then finish together on short tests, instead of one waiting out a long swarm test that came last."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
