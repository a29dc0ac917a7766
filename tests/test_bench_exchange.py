"""The large-model exchange benchmark's harness, end to end on a small model (no timing asserts)."""

import json
from pathlib import Path

import pytest

from lab.bench_exchange import main

pytestmark = pytest.mark.slow


def test_small_exchange_bench_merges_in_every_wire_dtype_and_writes_its_outputs(tmp_path: Path) -> None:
    assert main(["--params", "3e4", "--exchanges", "1", "--raw-mb", "2", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())
    assert [r["dtype"] for r in summary["table"]] == ["float32", "bfloat16", "float16", "int8"]
    assert all(r["merged"] == "2/2" for r in summary["table"]), summary["exchanges"]
    assert len(summary["raw_stream_mb_per_s"]) == 3 and min(summary["raw_stream_mb_per_s"]) > 0
    errors = summary["merge_errors"]
    assert errors["float32"]["vs_merge_delta"] == 0.0
    assert 0 < errors["float16"]["vs_merge_delta"] < errors["bfloat16"]["vs_merge_delta"] < errors["int8"]["vs_merge_delta"] < 1
    assert "| bfloat16 |" in (tmp_path / "results.md").read_text()
