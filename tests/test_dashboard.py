"""The dashboard: its server and JSON, its bounded history, a hostile peer summary in a real browser, and its
charts' labels measured in a real browser (inside their chart, not overlapping, round numbers)."""

from __future__ import annotations

import itertools
import json
import random
import socket
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import anyio
import pytest
from headless_chromium import chart_points, dump_dom, parse_dom, peer_rows, serve_files
from prometheus_client import CollectorRegistry, Counter
from status_example import example_status

from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.net.membership import PEERS_PROTOCOL, Membership, TaskIdentity
from murmur.node.net.peers import PeerTable
from murmur.node.net.transport import MemoryNetwork
from murmur.node.ops.dashboard import (
    STATIC_FILES,
    DashboardState,
    DashboardUnavailable,
    SwarmHistory,
    is_local,
    nonlocal_bind_warning,
    recent_partners,
    serve_dashboard,
    swarm_view,
)
from murmur.node.ops.metrics import MetricsUnavailable
from murmur.node.ops.node_status import NodeStatus
from murmur.protocol.messages import PeerSummary

pytestmark = pytest.mark.anyio
HOSTILE = '<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'">'


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def _status(peer_id: str = "12D3KooWself", t: float = 100.0, **changes: object) -> NodeStatus:
    return example_status(peer_id=peer_id, t=t, **changes)


def _summary(**overrides: object) -> PeerSummary:
    fields = dict(task="digits", samples_per_s=100.0, metric="accuracy", metric_value=0.7, loss=0.9, work=10.0,
                  phase="training", idle=0.5, partners=[])  # fmt: skip
    fields.update(overrides)
    return PeerSummary(**fields)  # type: ignore[arg-type]


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_history_is_bounded_per_peer_and_in_peers() -> None:
    history = SwarmHistory(max_points=3, max_peers=2)
    for i in range(5):
        history.record("a", {"t": i})
    history.record("b", {"t": 0})
    history.record("a", {"t": 5})  # a is now the most recently seen
    history.record("c", {"t": 0})  # evicts b, the longest unseen
    series = history.series()
    assert sorted(series) == ["a", "c"]
    assert [p["t"] for p in series["a"]] == [3, 4, 5]


def test_history_skips_a_repeated_summary_and_forgets_departed_peers() -> None:
    history = SwarmHistory()
    history.record("a", {"t": 1}, stamp=7.0)
    history.record("a", {"t": 2}, stamp=7.0)  # the same summary again: not a new point
    history.record("a", {"t": 3}, stamp=8.0)
    history.record("b", {"t": 3})
    history.keep_only(["b"])
    assert history.series() == {"b": [{"t": 3}]}


def test_swarm_view_lists_self_and_members_with_edges_and_history() -> None:
    history = SwarmHistory()
    recent = [Outcome(Result.MERGED, "peerA", "", 0.01), Outcome(Result.BUSY, "peerB", "in an exchange", 0.001)]
    summaries = {"peerA": (_summary(partners=["12D3KooWself", "peerB"]), 9.5), "peerB": (_summary(loss=None), 9.9)}
    view = swarm_view(_status(), summaries, history, 10.0, recent, {"in": {"/p": 5}, "out": {"/p": 7}})
    assert [p["peer_id"] for p in view["peers"]] == ["12D3KooWself", "peerA", "peerB"]
    me = view["peers"][0]
    assert (me["self"], me["metric"], me["metric_value"], me["idle"], me["partners"]) == (True, "accuracy", 0.8, 0.25, ["peerA"])
    assert view["peers"][1]["age_s"] == pytest.approx(0.5)
    assert view["edges"] == [["12D3KooWself", "peerA"], ["peerA", "peerB"]]
    assert set(view["history"]) == {"12D3KooWself", "peerA", "peerB"}
    assert view["history"]["12D3KooWself"][0]["bytes_out"] == 2000
    assert view["exchanges"][1]["reason"] == "in an exchange"
    assert view["traffic"] == {"in": {"/p": 5}, "out": {"/p": 7}}
    json.dumps(view, allow_nan=False)  # strict JSON: a browser's JSON.parse takes it


def test_a_member_without_a_summary_is_listed_with_empty_fields() -> None:
    history = SwarmHistory()
    view = swarm_view(_status(), {"peerA": (_summary(), 1.0)}, history, 1.0, [], {},
                      members=["peerA", "silent", "12D3KooWself"])  # fmt: skip
    assert [p["peer_id"] for p in view["peers"]] == ["12D3KooWself", "peerA", "silent"]
    silent = view["peers"][2]
    assert (silent["task"], silent["loss"], silent["age_s"], silent["partners"]) == ("", None, None, [])
    assert "silent" not in view["history"]


def test_history_values_are_rounded_to_five_digits() -> None:
    view = swarm_view(_status(loss=0.123456789, t=1765000000.123456), {}, SwarmHistory(), 0.0, [], {})
    (point,) = view["history"]["12D3KooWself"]
    assert (point["loss"], point["t"]) == (0.12346, 1765000000.12)


def test_swarm_view_before_training_has_no_nan() -> None:
    view = swarm_view(_status(loss=float("nan"), eval={}), {}, SwarmHistory(), 0.0, [], {})
    assert view["peers"][0]["loss"] is None and view["metric"] == ""
    json.dumps(view, allow_nan=False)


def test_recent_partners_are_distinct_merged_newest_last_and_capped() -> None:
    recent = [Outcome(Result.MERGED, p, "") for p in "abcab"] + [Outcome(Result.FAILED, "z", "timed out")]
    assert recent_partners(recent) == ["c", "a", "b"]
    assert recent_partners([Outcome(Result.MERGED, str(i), "") for i in range(20)], limit=8) == [
        str(i) for i in range(12, 20)
    ]


@pytest.mark.parametrize(("host", "local"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                             ("0.0.0.0", False), ("192.168.1.5", False), ("::", False)])  # fmt: skip
def test_only_a_loopback_bind_goes_without_a_warning(host: str, local: bool) -> None:
    assert is_local(host) is local
    warning = nonlocal_bind_warning(host)
    assert (warning is None) is local
    if warning:
        assert host in warning and "other machines" in warning


def test_the_page_ships_as_package_data_and_fetches_nothing_from_elsewhere() -> None:
    web = resources.files("murmur.node.ops").joinpath("web")
    for name, _ in STATIC_FILES.values():
        text = web.joinpath(name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    js = web.joinpath("dashboard.js").read_text()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "document.write" not in js


async def test_server_serves_page_json_metrics_and_nothing_else() -> None:
    registry = CollectorRegistry()
    Counter("murmur_test", "a test counter", registry=registry).inc(3)
    state = DashboardState(registry)
    async with serve_dashboard(state, "127.0.0.1", 0) as url:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        code, _, body = await anyio.to_thread.run_sync(_get, url + "api/swarm")
        assert (code, body) == (200, b"{}")  # before the node's first report
        state.publish(_status(), swarm_view(_status(), {}, SwarmHistory(), 0.0, [], {}))
        code, headers, body = await anyio.to_thread.run_sync(_get, url + "api/swarm")
        assert code == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body)["peers"][0]["peer_id"] == "12D3KooWself"
        code, _, body = await anyio.to_thread.run_sync(_get, url + "api/status")
        assert json.loads(body)["samples"] == 640
        code, headers, body = await anyio.to_thread.run_sync(_get, url)
        assert code == 200 and b"/dashboard.js" in body and "script-src 'self'" in headers["Content-Security-Policy"]
        code, _, body = await anyio.to_thread.run_sync(_get, url + "metrics")
        assert code == 200 and b"murmur_test_total 3.0" in body
        for path in ("nope", "../pyproject.toml", "api/", "web/index.html"):
            code, _, _ = await anyio.to_thread.run_sync(_get, url + path)
            assert code == 404, path
        request = urllib.request.Request(url + "api/swarm", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(request, timeout=5))
        assert info.value.code == 501  # read-only: no method but GET and HEAD


async def test_silent_connections_beyond_the_limit_are_closed_and_the_server_recovers() -> None:
    state = DashboardState()
    async with serve_dashboard(state, "127.0.0.1", 0, max_clients=2) as url:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # they send nothing
        try:
            with anyio.fail_after(10):
                while True:  # until the server has taken both: then a third connection is closed unanswered
                    try:
                        await anyio.to_thread.run_sync(_get, url + "api/swarm")
                    except OSError:  # closed unanswered (reset, or no status line)
                        break
                    await anyio.sleep(0.05)
        finally:
            for sock in silent:
                sock.close()
        with anyio.fail_after(10):
            while True:  # the silent clients' threads end on their EOF: the slots come back
                try:
                    code, _, body = await anyio.to_thread.run_sync(_get, url + "api/swarm")
                    break
                except OSError:  # closed unanswered (reset, or no status line)
                    await anyio.sleep(0.05)
        assert (code, body) == (200, b"{}")


async def test_a_taken_port_is_a_typed_error_naming_it() -> None:
    async with serve_dashboard(DashboardState(), "127.0.0.1", 0) as url:
        port = int(url.rsplit(":", 1)[1].strip("/"))
        with pytest.raises(DashboardUnavailable, match=f"cannot serve metrics and the dashboard on 127.0.0.1:{port}") as info:
            async with serve_dashboard(DashboardState(), "127.0.0.1", port):
                pass
        assert isinstance(info.value, MetricsUnavailable)  # `murmur run` reports it in one line


async def test_a_peer_that_names_itself_script_executes_nothing_in_a_real_browser(tmp_path: Path) -> None:
    """A hostile summary travels a real hello, is stored, served and rendered: it shows as text, runs nothing."""
    net = MemoryNetwork()
    hostile = _summary(task=HOSTILE[:64], phase="<b>x</b>", metric="<i>acc</i>", partners=[HOSTILE[:128]])
    tables = [PeerTable(f"peer{i}", liveness_timeout=1e9) for i in range(2)]
    ours, theirs = (
        Membership(net.transport(f"peer{i}"), tables[i], TaskIdentity("digits", "fp"), rng=random.Random(i),
                   summary=(lambda: None) if i == 0 else (lambda: hostile))
        for i in range(2)
    )  # fmt: skip
    theirs.transport.set_handler(PEERS_PROTOCOL, theirs.serve)
    async with ours.transport.run(), theirs.transport.run():
        assert await ours.greet("peer1", theirs.transport.addresses()) == "ok"
    summaries = ours.summaries()
    assert summaries["peer1"][0].task == HOSTILE[:64]
    state = DashboardState()
    history = SwarmHistory()
    for t in (1.0, 2.0):
        summaries = {"peer1": (summaries["peer1"][0], t)}  # two summaries: a line, not a dot
        state.publish(_status(t=t), swarm_view(_status(peer_id="peer0", t=t), summaries, history, t, [], {}))
    async with serve_dashboard(state, "127.0.0.1", 0) as url:
        html = await anyio.to_thread.run_sync(dump_dom, url)
    root, by_id = parse_dom(html)
    rows = peer_rows(by_id)
    assert set(rows) == {"peer0", "peer1"}
    assert HOSTILE[:64] in rows["peer1"] and "<b>x</b>" in rows["peer1"]  # shown as the text it is
    assert root.find_all("title")[0].all_text() == "Murmur swarm"  # neither payload ran
    assert not root.find_all("img") and not root.find_all("b") and not root.find_all("i")
    assert [s.attrs.get("src") for s in root.find_all("script")] == ["/chart.js", "/dashboard.js"]  # the page's own
    assert chart_points(by_id, "chart-loss")["peer1"] == 2


async def test_the_page_says_when_the_node_is_alone_and_why() -> None:
    alone = _status(joined=False, alone_reason="127.0.0.1:1: unreachable: connection refused")
    view = swarm_view(alone, {}, SwarmHistory(), 0.0, [], {})
    assert (view["joined"], view["alone_reason"]) == (False, "127.0.0.1:1: unreachable: connection refused")
    assert swarm_view(_status(), {}, SwarmHistory(), 0.0, [], {})["joined"] is True
    state = DashboardState()
    state.publish(alone, view)
    async with serve_dashboard(state, "127.0.0.1", 0) as url:
        html = await anyio.to_thread.run_sync(dump_dom, url)
    _, by_id = parse_dom(html)
    assert by_id["state"].all_text().startswith("alone: 127.0.0.1:1: unreachable: connection refused · updated ")


def _swarm_of(points: int, loss: list[float], metric: list[float], samples_per_s: list[float], idle: list[float],
              bytes_per_s: float) -> dict:
    """A two-peer swarm view after `points` reports 2 s apart; the values run linearly from first to last."""
    history = SwarmHistory()

    def at(pair: list[float], i: int) -> float:
        return pair[0] + (pair[1] - pair[0]) * i / (points - 1)

    view: dict = {}
    for i in range(points):
        t = 1000.0 + 2 * i
        status = _status(peer_id="peer0", t=t, loss=at(loss, i), eval={"accuracy": at(metric, i)},
                         samples_per_s=at(samples_per_s, i), compute_fraction=1 - at(idle, i),
                         bytes_in=int(bytes_per_s * 2 * i), bytes_out=int(bytes_per_s * 2 * i))  # fmt: skip
        summary = _summary(loss=at(loss, i) * 3, metric_value=at(metric, i) / 2, samples_per_s=at(samples_per_s, i) / 2,
                           idle=at(idle, i))  # fmt: skip
        view = swarm_view(status, {"peer1": (summary, t)}, history, t, [], {})
    return view


def _chart_boxes(swarm: dict) -> dict:
    """The page drawing `swarm` in headless Chromium, measured by tests/chart_boxes.js: chart id -> boxes, lines."""
    web = resources.files("murmur.node.ops").joinpath("web")
    files = {path: (web.joinpath(name).read_bytes(), kind) for path, (name, kind) in STATIC_FILES.items()}
    own = b'<script src="/dashboard.js" defer></script>'
    files["/"] = (files["/"][0].replace(own, own + b'\n<script src="/chart_boxes.js" defer></script>'), files["/"][1])
    assert b"chart_boxes.js" in files["/"][0]
    files["/chart_boxes.js"] = ((Path(__file__).parent / "chart_boxes.js").read_bytes(), "text/javascript")
    files["/api/swarm"] = (json.dumps(swarm).encode(), "application/json")
    with serve_files(files) as url:
        _, by_id = parse_dom(dump_dom(url))
    assert "boxes" in by_id, "the charts were never drawn"
    return json.loads(by_id["boxes"].all_text())


def _overlap(a: list[float], b: list[float]) -> bool:
    slack = 0.5  # px: neighbours that touch are not overlapping
    return a[0] < b[2] - slack and b[0] < a[2] - slack and a[1] < b[3] - slack and b[1] < a[3] - slack


SWARMS = {
    # Tiny losses falling over decades, big throughput, equal traffic in and out: the page's old worst case.
    "tiny": {"points": 12, "loss": [0.00753, 0.000457], "metric": [0.9, 0.97], "samples_per_s": [123456, 234567],
             "idle": [0.0, 0.05], "bytes_per_s": 5e8},
    "flat": {"points": 3, "loss": [2.3026, 2.3026], "metric": [0.1, 0.1], "samples_per_s": [0, 0], "idle": [1, 1],
             "bytes_per_s": 0},
    "wide": {"points": 40, "loss": [1200.0, 3e-6], "metric": [-3.2, -0.4], "samples_per_s": [1.5, 3.25],
             "idle": [0.5, 0.51], "bytes_per_s": 300},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SWARMS))
def test_chart_labels_fit_inside_their_chart_differ_from_their_neighbours_and_do_not_overlap(name: str) -> None:
    charts = _chart_boxes(_swarm_of(**SWARMS[name]))
    assert set(charts) == {"chart-loss", "chart-metric", "chart-throughput", "chart-idle", "chart-traffic"}
    for chart, drawn in charts.items():
        left, top, right, bottom = drawn["box"]
        for text in drawn["texts"]:
            x0, y0, x1, y1 = text["box"]
            assert left - 0.5 <= x0 and x1 <= right + 0.5 and top - 0.5 <= y0 and y1 <= bottom + 0.5, (chart, text)
        for i, a in enumerate(drawn["texts"]):
            for b in drawn["texts"][i + 1 :]:
                assert not _overlap(a["box"], b["box"]), (chart, a, b)
        ticks = [t["text"] for t in drawn["texts"] if t["cls"] == "y-tick"]
        assert len(ticks) >= 3 and all(a != b for a, b in itertools.pairwise(ticks)), (chart, ticks)  # precise enough
        assert next(t["text"] for t in drawn["texts"] if t["cls"] == "x-tick") == "now"
    received, sent = charts["chart-traffic"]["lines"]
    assert received["points"] != sent["points"] or name == "flat"  # the same bytes each way: two lines, not one
    assert (received["stroke"], received["dash"]) != (sent["stroke"], sent["dash"])
    swatches = charts["chart-traffic"]["swatches"]  # the legend shows each line's colour and dash
    assert swatches == [{"stroke": line["stroke"], "dash": line["dash"]} for line in (received, sent)]


def test_ticks_are_round_numbers_in_readable_units() -> None:
    charts = _chart_boxes(_swarm_of(**SWARMS["tiny"]))
    ticks = {c: [t["text"] for t in d["texts"] if t["cls"] == "y-tick"] for c, d in charts.items()}
    assert ticks["chart-loss"] == ["0.0002", "0.0005", "0.001", "0.002", "0.005", "0.01", "0.02", "0.05"]
    assert ticks["chart-throughput"] == ["0", "50k", "100k", "150k", "200k", "250k"]
    assert ticks["chart-traffic"] == ["600 MB/s", "400 MB/s", "200 MB/s", "0", "200 MB/s", "400 MB/s", "600 MB/s"]
    assert [t["text"] for t in charts["chart-loss"]["texts"] if t["cls"] == "x-tick"] == ["now", "−5 s", "−10 s",
                                                                                        "−15 s", "−20 s"]  # fmt: skip
    legend = [t["text"] for t in charts["chart-traffic"]["texts"] if "tick" not in t["cls"]]
    assert legend == ["received (up)", "sent (down)"]
    wide = _chart_boxes(_swarm_of(**SWARMS["wide"]))
    assert [t["text"] for t in wide["chart-metric"]["texts"] if t["cls"] == "y-tick"] == ["−4", "−3", "−2", "−1", "0"]
    assert [t["text"] for t in wide["chart-loss"]["texts"] if t["cls"] == "x-tick"] == ["now", "−30 s", "−1 min"]
