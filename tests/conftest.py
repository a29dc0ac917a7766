import logging

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # py-libp2p is Trio-native; every async test runs on AnyIO's Trio backend.
    return "trio"


@pytest.fixture(autouse=True)
def _quiet_libp2p() -> None:
    for name in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
