"""`murmur run` settings: flags > MURMUR_* environment > --config TOML file > defaults, and clear errors."""

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from murmur.node.cli import main
from murmur.node.ops.config import (
    DEFAULT_DATA_DIR,
    Emulation,
    NodeConfig,
    RunOptions,
    add_options,
    option,
    run_settings,
)
from murmur.node.ops.config_sources import ConfigError, env_name, resolve_options
from murmur.node.ops.run import build_run_parser

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"  # generated: tests/test_docs.py


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_run_parser()


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "murmur.toml"
    path.write_text(text)
    return path


BOOT_A = "/ip4/10.0.0.2/tcp/1/p2p/12D3KooWBEMKnE3g98ft739AEuZJHgHk8eERK2W6sxREhoqsxV5W"
BOOT_B = "/ip4/10.0.0.3/tcp/1/p2p/12D3KooWMWEragtfmqe1iTDRvGnW7rd7RcskWi1wkUtUepsQPiYs"


def test_flags_beat_environment_beats_file_beats_defaults(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    config = _toml(tmp_path, 'average-every = 0.5\nexchange_timeout = 3\nbootstrap = ["/ip4/10.0.0.1/tcp/1/p2p/12D3KooWBfiGnSaqW85bxxy8GnoQQJ4S9mBd7aWwazfrGtgEmEMh"]\n'
                             'no-state-sync = true\nweighting = "uniform"\ndata-dir = "~/murmur-data"\n')  # fmt: skip
    env = {"MURMUR_AVERAGE_EVERY": "0.25", "MURMUR_BOOTSTRAP": f"{BOOT_A}, {BOOT_B}",
           "MURMUR_WEIGHTING": "work"}  # fmt: skip
    args = resolve_options(parser, ["--config", str(config), "--weighting", "uniform"], env)
    assert args.weighting == "uniform"  # flag over environment
    assert args.average_every == 0.25  # environment over file
    assert args.bootstrap == [BOOT_A, BOOT_B]  # a list from one variable
    assert args.exchange_timeout == 3.0 and isinstance(args.exchange_timeout, float)  # file, underscore key
    assert args.sync_state is False  # `no-state-sync = true`
    assert args.data_dir == Path.home() / "murmur-data"  # `~` expanded: no shell saw it
    assert args.liveness_timeout == 10.0  # default


def test_a_repeated_flag_replaces_the_environment_list(parser: argparse.ArgumentParser) -> None:
    env = {"MURMUR_LISTEN": "/ip4/0.0.0.0/tcp/4001 /ip4/0.0.0.0/tcp/4002"}
    assert resolve_options(parser, [], env).listen == ["/ip4/0.0.0.0/tcp/4001", "/ip4/0.0.0.0/tcp/4002"]
    assert resolve_options(parser, ["--listen", "/ip4/127.0.0.1/tcp/5"], env).listen == ["/ip4/127.0.0.1/tcp/5"]


def test_the_file_can_be_named_by_the_environment_and_flags_can_be_switched_off_there(
    parser: argparse.ArgumentParser, tmp_path: Path
) -> None:
    config = _toml(tmp_path, "relay-service = true\nmetrics-port = 9100\n")
    args = resolve_options(parser, [], {"MURMUR_CONFIG": str(config), "MURMUR_RELAY_SERVICE": "off"})
    assert (args.metrics_port, args.relay_service, args.config) == (9100, False, config)


def test_every_run_option_is_explained_and_configurable(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    reference = REFERENCE.read_text()
    for action in options:
        name = action.option_strings[-1]
        assert action.help and len(action.help) > 10, f"{name} has no help text"
        assert f"`{name}`" in reference, f"{name} is missing from docs/configuration.md"
    # A setting added later as an `option` field is a flag, a variable and a key with no other change.
    @dataclass
    class Later:
        made_up_size: int = option(8, "an option added later")

    extended = build_run_parser()
    add_options(extended, (Later,))
    assert resolve_options(extended, [], {}).made_up_size == 8
    assert env_name("made-up-size") == "MURMUR_MADE_UP_SIZE"
    assert resolve_options(extended, [], {"MURMUR_MADE_UP_SIZE": "12"}).made_up_size == 12
    assert resolve_options(extended, ["--config", str(_toml(tmp_path, "made_up_size = 5\n"))], {}).made_up_size == 5


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ("bootstrapp = []\n", {}, r"unknown key 'bootstrapp' \(did you mean 'bootstrap'\?\)"),
        ("average-every = 'fast'\n", {}, r"key 'average-every': invalid value 'fast' for --average-every"),
        ("weighting = 'loudest'\n", {}, r"key 'weighting': invalid value 'loudest' for --weighting \(choose from"),
        ("task = true\n", {}, r"key 'task': --task takes one number or string, got True"),
        ("max-connections = 2.5\n", {}, r"key 'max-connections': invalid value 2.5 for --max-connections"),
        ("exchange-share = 1.5\n", {}, r"key 'exchange-share': invalid value 1.5 for --exchange-share: 1.5 is not a fraction"),
        ("compression-bits = 3\n", {}, r"key 'compression-bits': invalid value 3 for --compression-bits: 3 is not one of \[2, 4, 8\]"),
        ("compression = 'zip'\n", {}, r"key 'compression': invalid value 'zip' for --compression \(choose from"),
        ("ema-decay = 1\n", {}, r"key 'ema-decay': invalid value 1 for --ema-decay: 1.0 is not a decay in \[0, 1\)"),
        ("listen = 5\n", {}, r"key 'listen': --listen takes a list"),
        ("duration = [1, 2]\n", {}, r"key 'duration': --duration takes one number or string"),
        (
            "metrics-port = 70000\n",
            {},
            r"key 'metrics-port': invalid value 70000 for --metrics-port: port 70000 is not",
        ),
        ("relay-service = 'maybe'\n", {}, r"key 'relay-service': --relay-service is a flag"),
        ("[run]\ntask = 'digits'\n", {}, r"unknown key 'run'"),
        ("task = \n", {}, r"not valid TOML"),
        ("", {"MURMUR_METRICS_PORT": "lots"}, r"MURMUR_METRICS_PORT: invalid value 'lots' for --metrics-port"),
        ("", {"MURMUR_NO_STATE_SYNC": "perhaps"}, r"MURMUR_NO_STATE_SYNC: --no-state-sync is a flag"),
        ("", {"MURMUR_LOG_LEVEL": "chatty"}, r"MURMUR_LOG_LEVEL: invalid value 'chatty' for --log-level"),
    ],
)
def test_bad_settings_name_their_key(
    parser: argparse.ArgumentParser, tmp_path: Path, toml: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_options(parser, ["--config", str(_toml(tmp_path, toml))], env)


def test_a_missing_config_file_is_one_line_and_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--config", str(tmp_path / "absent.toml")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"murmur run: error: cannot read config file .*absent\.toml: No such file or directory\n", err)


def test_the_documented_example_config_is_valid(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    example = re.search(r"```toml\n(.*?)```", REFERENCE.read_text(), re.DOTALL)
    assert example, "docs/configuration.md has no TOML example"
    args = resolve_options(
        parser, ["--config", str(_toml(tmp_path, example.group(1)))], {"MURMUR_METRICS_PORT": "9200"}
    )
    assert (args.data_dir, args.metrics_port, args.log_format) == (Path("/data"), 9200, "json")


BOOT_C = "/ip4/10.0.0.4/tcp/4001/p2p/12D3KooWBfiGnSaqW85bxxy8GnoQQJ4S9mBd7aWwazfrGtgEmEMh"
RELAY = "/ip4/10.0.0.9/tcp/4001/p2p/12D3KooWMWEragtfmqe1iTDRvGnW7rd7RcskWi1wkUtUepsQPiYs"


def _settings(argv: list[str], env: dict[str, str] | None = None) -> tuple[NodeConfig, RunOptions]:
    config, options, _ = run_settings(resolve_options(build_run_parser(), argv, env or {}))
    return config, options


def test_every_option_defaults_to_its_field_default(parser: argparse.ArgumentParser) -> None:
    defaults = {**vars(NodeConfig()), **vars(RunOptions()), **vars(Emulation())}
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} <= set(defaults)
    for action in options:
        assert action.default == defaults[action.dest], action.option_strings
    assert run_settings(resolve_options(build_run_parser(), [], {})) == (NodeConfig(), RunOptions(), Emulation())
    assert NodeConfig().data_dir == DEFAULT_DATA_DIR and NodeConfig().listen == ["/ip4/0.0.0.0/tcp/0"]


def test_settings_from_flags_equal_the_hand_built_ones(tmp_path: Path) -> None:
    argv = [
        "--data-dir", str(tmp_path), "--task", "charlm", "--run-id", "r1", "--listen", "/ip4/127.0.0.1/tcp/4001",
        "--listen", "/ip4/127.0.0.1/tcp/4002", "--bootstrap", BOOT_A, "--announce", "/ip4/203.0.113.7/tcp/4001",
        "--relay", RELAY, "--relay-service", "--addr-file", str(tmp_path / "addrs"),
        "--weighting", "uniform", "--average-every", "0.5", "--exchange-timeout", "3",
        "--liveness-timeout", "4", "--view-size", "0", "--eval-every", "2", "--duration", "60", "--shard", "7",
        "--no-state-sync", "--checkpoint-every", "5",
        "--allow-peers", str(tmp_path / "peers"), "--swarm-secret-file", str(tmp_path / "secret"),
        "--max-connections", "50", "--wire-dtype", "int8", "--device", "cpu", "--mixed-precision",
        "--metrics-port", "9100", "--metrics-host", "0.0.0.0", "--threads", "2", "--log-level", "debug",
        "--log-format", "json",
    ]  # fmt: skip
    config, options = _settings(argv)
    assert config == NodeConfig(
        data_dir=tmp_path, task="charlm", run_id="r1", listen=["/ip4/127.0.0.1/tcp/4001", "/ip4/127.0.0.1/tcp/4002"],
        bootstrap=[BOOT_A], announce=["/ip4/203.0.113.7/tcp/4001"], relays=[RELAY], relay_service=True,
        addr_file=tmp_path / "addrs", weighting="uniform", average_every=0.5,
        exchange_timeout=3.0, liveness_timeout=4.0, view_size=None, eval_every=2.0, duration=60.0, shard=7,
        sync_state=False, checkpoint_every=5.0,
        allow_peers=tmp_path / "peers", swarm_secret_file=tmp_path / "secret", max_connections=50, wire_dtype="int8",
        device="cpu", mixed_precision=True, metrics_port=9100, metrics_host="0.0.0.0", threads=2,
    )  # fmt: skip
    assert options == RunOptions(log_level="DEBUG", log_format="json")


def test_renamed_and_inverted_options_layer_like_the_others(tmp_path: Path) -> None:
    config = _toml(tmp_path, f'relay = ["{RELAY}"]\nview_size = 0\nno-state-sync = true\nthreads = 3\n')
    env = {"MURMUR_RELAY": "auto", "MURMUR_NO_STATE_SYNC": "false", "MURMUR_CONFIG": str(config)}
    node, options = _settings(["--threads", "1"], env)
    assert (node.relays, node.sync_state, node.threads) == (["auto"], True, 1)  # environment over file; flag over all
    assert (node.view_size, options.config) == (None, config)  # from the file
    assert _settings(["--view-size", "5"], {"MURMUR_VIEW_SIZE": "0"})[0].view_size == 5


def test_an_empty_list_keeps_the_default_listen_address(tmp_path: Path) -> None:
    assert _settings([], {"MURMUR_LISTEN": ""})[0].listen == ["/ip4/0.0.0.0/tcp/0"]
    assert _settings(["--config", str(_toml(tmp_path, "listen = []\n"))])[0].listen == ["/ip4/0.0.0.0/tcp/0"]
    assert _settings([], {"MURMUR_BOOTSTRAP": ""})[0].bootstrap == []


# A murmur.toml that sets every option of `murmur run`.
EVERY_KEY_TOML = f"""
task = "digits"
run-id = "swarm-1"
data-dir = "/data"
listen = ["/ip4/0.0.0.0/tcp/4001"]
bootstrap = ["{BOOT_C}"]
addr-file = "/data/addrs.txt"
announce = ["/ip4/203.0.113.7/tcp/4001"]
relay = ["{RELAY}"]
relay-service = true
slowdown = 1.5
weighting = "uniform"
merge = "average"
average-every = 0.2
exchange-share = 0.25
exchange-share-of = "wall"
exchange_timeout = 5
min-link-mbit = 2.5
partners = "uniform"
score-windows = 64
score-tolerance = 0.02
liveness-timeout = 12
view-size = 0
eval-every = 2
duration = 600
shard = 3
no-state-sync = true
no-nat-traversal = true
checkpoint-every = 60
progress-every = 10
allow-peers = "/data/peers.txt"
swarm-secret-file = "/data/secret"
wire-dtype = "bfloat16"
compression = "sparse"
compression-density = 0.02
compression-bits = 4
optimizer-state = "keep"
ema-decay = 0.5
max-connections = 100
log-level = "warning"
log_format = "json"
metrics-port = 9100
metrics-host = "0.0.0.0"
device = "cpu"
mixed-precision = false
threads = 4
tensorboard = "/data/tb"
wandb = "my-swarm"
"""


def test_a_murmur_toml_with_every_option_loads(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    flags = {s.removeprefix("--") for a in parser._actions for s in a.option_strings if s.startswith("--")}
    keys = {line.split(" = ")[0].replace("_", "-") for line in EVERY_KEY_TOML.strip().splitlines()}
    assert flags - {"help", "config"} == keys  # the file cannot name a file
    settings = run_settings(resolve_options(build_run_parser(), ["--config", str(_toml(tmp_path, EVERY_KEY_TOML))], {}))
    node, options, emulation = settings
    assert node == NodeConfig(
        data_dir=Path("/data"), task="digits", run_id="swarm-1", listen=["/ip4/0.0.0.0/tcp/4001"], bootstrap=[BOOT_C],
        addr_file=Path("/data/addrs.txt"), announce=["/ip4/203.0.113.7/tcp/4001"], relays=[RELAY], relay_service=True,
        weighting="uniform", merge="average", average_every=0.2, exchange_share=0.25, exchange_share_of="wall", exchange_timeout=5.0,
        min_link_mbit=2.5, partners="uniform", score_windows=64, score_tolerance=0.02, liveness_timeout=12.0, view_size=None, eval_every=2.0, duration=600.0, shard=3, sync_state=False, nat_traversal=False,
        checkpoint_every=60.0, progress_every=10.0, allow_peers=Path("/data/peers.txt"), swarm_secret_file=Path("/data/secret"),
        wire_dtype="bfloat16", compression="sparse", compression_density=0.02, compression_bits=4,
        optimizer_state="keep", ema_decay=0.5, max_connections=100, metrics_port=9100, metrics_host="0.0.0.0", device="cpu", threads=4,
        tensorboard=Path("/data/tb"), wandb="my-swarm",
    )  # fmt: skip
    assert (options.log_level, options.log_format, emulation) == ("WARNING", "json", Emulation(slowdown=1.5))


def test_relay_auto_is_a_relay_value_and_nat_traversal_is_on_by_default() -> None:
    node, _ = _settings(["--relay", "auto", "--relay", RELAY])
    assert (node.relays, node.nat_traversal) == (["auto", RELAY], True)
    assert _settings(["--no-nat-traversal"])[0].nat_traversal is False
    with pytest.raises(SystemExit):
        _settings(["--relay", "automatic"])


TASKS_LINE = "tasks: digits, charlm, charlm-large, or package.module:factory for your own"


@pytest.mark.parametrize("source", ["flag", "toml"])
def test_a_typo_in_the_task_is_one_line_with_a_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture, source: str) -> None:
    argv = ["run", "--task", "digit"] if source == "flag" else ["run", "--config", str(_toml(tmp_path, 'task = "digit"\n'))]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    where = "argument --task" if source == "flag" else f"{tmp_path / 'murmur.toml'}: key 'task': invalid value 'digit' for --task"
    hint = " (murmur run --help for the options)" if source == "flag" else ""
    assert capsys.readouterr().err == f"murmur run: error: {where}: unknown task 'digit': did you mean 'digits'? {TASKS_LINE}{hint}\n"


def test_task_help_lists_every_built_in_task(parser: argparse.ArgumentParser) -> None:
    from murmur.node.learn.tasks import BUILTIN_TASKS

    text = " ".join(parser.format_help().split())
    assert f"a built-in task ({', '.join(BUILTIN_TASKS)})" in text
    assert "charlm-large" in text


def test_help_shows_the_defaults_of_options_that_have_one(parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())
    assert "seconds between averaging attempts (default 0.1)" in text
    assert "--checkpoint-every SECONDS checkpoint this often (and on exit) (default 30.0)" in text
    assert "(default None)" not in text and "(default False)" not in text  # nothing to show: nothing shown
