"""`murmur run` settings: flags > MURMUR_* environment > --config TOML file > defaults, and clear errors."""

import argparse
import re
from pathlib import Path

import pytest

from node.ops.cli import build_run_parser, main
from node.ops.config import ConfigError, env_name, resolve_options

README = Path(__file__).resolve().parent.parent / "README.md"


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
    config = _toml(tmp_path, "record-params = true\nmetrics-port = 9100\n")
    args = resolve_options(parser, [], {"MURMUR_CONFIG": str(config), "MURMUR_RECORD_PARAMS": "off"})
    assert (args.metrics_port, args.record_params, args.config) == (9100, False, config)


def test_every_run_option_is_explained_and_configurable(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    readme = README.read_text()
    for action in options:
        name = action.option_strings[-1]
        assert action.help and len(action.help) > 10, f"{name} has no help text"
        assert f"`{name}" in readme, f"{name} is missing from README.md's option table"
    # An option added to the parser later is settable with no change to the config layer.
    extended = build_run_parser()
    extended.add_argument("--made-up-size", type=int, default=8, help="an option added later")
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
        ("listen = 5\n", {}, r"key 'listen': --listen takes a list"),
        ("duration = [1, 2]\n", {}, r"key 'duration': --duration takes one number or string"),
        (
            "metrics-port = 70000\n",
            {},
            r"key 'metrics-port': invalid value 70000 for --metrics-port: port 70000 is not",
        ),
        ("record-params = 'maybe'\n", {}, r"key 'record-params': --record-params is a flag"),
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


def test_the_readme_example_config_is_valid(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    example = re.search(r"```toml\n(.*?)```", README.read_text(), re.DOTALL)
    assert example, "README.md has no TOML example"
    args = resolve_options(
        parser, ["--config", str(_toml(tmp_path, example.group(1)))], {"MURMUR_METRICS_PORT": "9200"}
    )
    assert (args.data_dir, args.metrics_port, args.log_format) == (Path("/data"), 9200, "json")
