"""`NodeStatus`: status.json written by `to_json`, read back by `from_json`, and refused when it is not a status."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from status_example import EXAMPLE, example_status

from murmur.node.averaging.outcome import Result
from murmur.node.ops.node_status import NetworkStatus, NodeStatus, NotAStatus, current_trio_task_names, current_trio_tasks

# Keys that `murmur status`, its --health check, the lab and scripts read from status.json.
INTERFACE_KEYS = {
    "peer_id", "addrs", "task", "device", "t", "phase", "uptime_s", "samples", "samples_per_s", "weight", "loss", "eval",
    "exchanges", "recent_exchanges", "mean_exchange_s", "bytes_sent", "known_peers", "peers", "compute_fraction",
    "eval_fraction", "pid", "status_interval", "bytes_in", "bytes_out", "partner_distance", "metrics_url",
    "dashboard_url", "reachability", "reachability_reason", "connections", "relayed_via", "relays", "hole_punched",
    "relayed_bytes", "joined", "alone_reason", "bootstrap", "bytes_per_merge", "model_bytes",
    "trio_tasks", "trio_task_names",
}  # fmt: skip


def test_a_status_survives_its_json_round_trip() -> None:
    assert NodeStatus.from_json(EXAMPLE.to_json()) == EXAMPLE


def test_status_json_keeps_its_keys_and_adds_work() -> None:
    doc = json.loads(EXAMPLE.to_json())
    assert set(doc) == INTERFACE_KEYS | {"work"}
    assert doc["weight"] == doc["work"] == 640.0
    assert doc["exchanges"] == {"merged": 1, "busy": 1}
    assert doc["recent_exchanges"][0] == {"result": "merged", "partner": "peerA", "reason": EXAMPLE.recent_exchanges[0].reason,
                                          "duration_s": 0.01, "remote_share": 0.5, "bytes_sent": 4096, "cpu_s": 0.0}  # fmt: skip
    assert doc["connections"] == {"peerA": "direct", "peerB": "relayed"} and doc["relays"] == list(EXAMPLE.network.relays)


def test_outcomes_read_back_as_result_members() -> None:
    status = NodeStatus.from_json(EXAMPLE.to_json())
    assert [o.result for o in status.recent_exchanges] == [Result.MERGED, Result.BUSY]
    assert all(isinstance(o.result, Result) for o in status.recent_exchanges)
    assert status.exchanges.get(Result.MERGED, 0) == 1


def test_nan_before_the_first_step_and_absent_values_round_trip() -> None:
    before = example_status(loss=math.nan, eval={}, partner_distance=None, mean_exchange_s=None, recent_exchanges=())
    again = NodeStatus.from_json(before.to_json())
    assert math.isnan(again.loss) and again.partner_distance is None and again.recent_exchanges == ()


def test_work_is_read_from_weight_when_work_is_absent() -> None:
    doc = json.loads(EXAMPLE.to_json())
    del doc["work"]
    doc["weight"] = 99.0
    assert NodeStatus.from_json(json.dumps(doc)).work == 99.0


def test_a_transport_without_nat_traversal_reports_the_default_network() -> None:
    doc = json.loads(EXAMPLE.to_json())
    for key in (f.name for f in dataclasses.fields(NetworkStatus)):
        del doc[key]
    assert NodeStatus.from_json(json.dumps(doc)).network == NetworkStatus()


def _without(key: str) -> str:
    doc = json.loads(EXAMPLE.to_json())
    del doc[key]
    return json.dumps(doc)


def _with(key: str, value: object) -> str:
    return json.dumps({**json.loads(EXAMPLE.to_json()), key: value})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "not a Murmur status file: a JSON list"),
        ('{"peer_id": "x"}', "not a Murmur status file: no"),
        (_without("t"), "no 't'"),
        (_with("t", "yesterday"), "'t' is 'yesterday', not float"),
        (_with("samples", True), "'samples' is True, not int"),
        (_with("addrs", "/ip4/1.2.3.4"), "'addrs' is '/ip4/1.2.3.4'"),
        (_with("reachability", 3), "'reachability' is 3, not str"),
        (_with("recent_exchanges", [{"result": "exploded", "partner": "", "reason": ""}]), "'result' is 'exploded'"),
    ],
)
def test_anything_else_is_not_a_status(text: str, message: str) -> None:
    with pytest.raises(NotAStatus, match=message):
        NodeStatus.from_json(text)


def test_a_status_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EXAMPLE.samples = 0  # type: ignore[misc]


def test_a_status_from_before_joined_was_written_reads_as_joined() -> None:
    doc = json.loads(EXAMPLE.to_json())
    for key in ("joined", "alone_reason", "bootstrap"):
        del doc[key]
    status = NodeStatus.from_json(json.dumps(doc))
    assert status.joined and status.alone_reason is None
    alone = dataclasses.replace(EXAMPLE, joined=False, alone_reason="127.0.0.1:1: unreachable: connection refused")
    assert NodeStatus.from_json(alone.to_json()) == alone


def test_trio_tasks_counts_the_live_tasks_of_the_calling_trio_run() -> None:
    import trio

    async def main() -> tuple[int | None, int | None]:
        before = current_trio_tasks()
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(trio.sleep_forever)
            await trio.lowlevel.checkpoint()
            during = current_trio_tasks()
            nursery.cancel_scope.cancel()
        return before, during

    before, during = trio.run(main)
    assert before is not None and during == before + 3
    assert current_trio_tasks() is None  # outside a Trio run


def test_trio_task_names_counts_the_tasks_of_the_calling_trio_run_by_name() -> None:
    import trio

    async def main() -> tuple[dict[str, int], int | None]:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(trio.sleep_forever)
            await trio.lowlevel.checkpoint()
            names, living = current_trio_task_names(), current_trio_tasks()
            nursery.cancel_scope.cancel()
        return names, living

    names, living = trio.run(main)
    assert names["trio.sleep_forever"] == 3 and sum(names.values()) == living  # every living task, Trio's own too
    assert current_trio_task_names() == {}  # outside a Trio run


def test_a_status_without_trio_tasks_reads_back_as_none() -> None:
    doc = json.loads(EXAMPLE.to_json())
    del doc["trio_tasks"]
    assert NodeStatus.from_json(json.dumps(doc)).trio_tasks is None
    assert NodeStatus.from_json(dataclasses.replace(EXAMPLE, trio_tasks=7).to_json()).trio_tasks == 7
