"""Node log output: readable lines by default, one JSON object per line with `--log-format json`."""

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest

from murmur.node.ops.logs import configure_logging, exit_summary, progress_line

PEER = "12D3KooWAbCdEfGhIjKlMnOpQrStUvWxYz0123456789abcdef"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    logging.captureWarnings(False)
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_time_level_logger_message_and_peer() -> None:
    out = io.StringIO()
    configure_logging("info", PEER, "json", stream=out)
    logging.getLogger("murmur.averager").info("exchange with %s: %s", "peer-b", "merged\nin 0.1s")
    logging.getLogger("murmur.node").debug("below the level")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("murmur.node").exception("failed")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old API", DeprecationWarning, stacklevel=1)
    lines = out.getvalue().splitlines()
    entries = [json.loads(line) for line in lines]
    assert len(entries) == 3
    first = entries[0]
    assert set(first) == {"time", "level", "logger", "message", "peer"}
    assert (first["level"], first["logger"], first["peer"]) == ("INFO", "murmur.averager", PEER)
    assert first["message"] == "exchange with peer-b: merged\nin 0.1s"
    assert first["time"].endswith("+00:00") and "T" in first["time"]
    assert entries[1]["level"] == "ERROR" and "ValueError: boom" in entries[1]["exception"]
    assert entries[2]["logger"] == "py.warnings" and "old API" in entries[2]["message"]


def test_text_lines_are_tagged_with_the_peer() -> None:
    out = io.StringIO()
    configure_logging("INFO", PEER, stream=out)
    logging.getLogger("murmur.node").warning("disk %s", "full")
    assert out.getvalue() == f"murmur[{PEER[-8:]}] WARNING murmur.node: disk full\n"


def test_unknown_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        configure_logging("INFO", PEER, "xml")
    with pytest.raises(ValueError):
        configure_logging("CHATTY", PEER, "text", stream=io.StringIO())


def test_the_progress_line_gives_rate_loss_metric_merges_and_peers_in_one_short_line() -> None:
    from status_example import example_status

    before = example_status(samples=1000, uptime_s=10.0)
    now = example_status(samples=13_300, uptime_s=11.0, loss=0.00312, eval={"accuracy": 0.9781, "loss": 0.118},
                         exchanges={"merged": 12, "busy": 3}, known_peers=3, joined=True)  # fmt: skip
    line = progress_line(now, before)
    assert line == "12.3k samples/s, loss 0.00312, accuracy 0.978, 12 merges, 3 peers"
    assert len(f"murmur[abcdefgh] INFO murmur.node: {line}") <= 100
    alone = example_status(samples=0, uptime_s=5.0, samples_per_s=0.0, loss=float("nan"), eval={},
                           exchanges={}, known_peers=0, joined=False)  # fmt: skip
    assert progress_line(alone) == "0 samples/s, loss n/a, 0 merges, alone"
    assert exit_summary(now) == f"done after 11 s, 13300 samples: {_si_rate(now)} samples/s, loss 0.00312, accuracy 0.978, 12 merges, 3 peers"


def _si_rate(status) -> str:  # noqa: ANN001
    from murmur.node.ops.logs import _si

    return _si(status.samples_per_s)
