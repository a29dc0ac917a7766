"""The `murmur` command's process behaviour: stop signals end it cleanly, never with a signal; errors are
one line; a closed pipe, `--version` and a torch-free health check."""

import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_a_stop_request_after_the_command_finished_does_not_kill_it(tmp_path: Path) -> None:
    # A supervisor that sends SIGTERM just as a command ends must still see exit status 0.
    script = (
        "import os, signal, sys\n"
        "from murmur.node.cli import main\n"
        f"code = main(['id', '--data-dir', {str(tmp_path)!r}])\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('still here', flush=True)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout


def _murmur(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "murmur.node.cli", *args], capture_output=True, text=True, timeout=120,
                          check=False, **kwargs)  # fmt: skip


def _write_status(data_dir: Path) -> None:
    from status_example import example_status

    from murmur.node.ops.status import STATUS_FILE

    data_dir.mkdir(parents=True, exist_ok=True)
    many = tuple(f"/ip4/10.0.0.{i}/tcp/4001/p2p/12D3KooWself" for i in range(4000))  # more than a pipe holds
    (data_dir / STATUS_FILE).write_text(example_status(addrs=many, pid=os.getpid(), t=time.time()).to_json())


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path: Path) -> None:
    # `murmur status --json | head -1`: head exits after one line; murmur must end quietly.
    _write_status(tmp_path)
    command = f"{shlex.quote(sys.executable)} -m murmur.node.cli status --json --data-dir {tmp_path} | head -c 1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout == "{"
    assert done.stderr == ""
    assert done.returncode == 1  # Python's advice for a closed pipe (pipefail passes it on)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "--bogus"], "murmur run: error: unrecognized arguments: --bogus (murmur run --help for the options)"),
        (["status", "--json", "--health"], ("murmur status: error: argument --health: not allowed with argument --json "
                                            "(murmur status --help for the options)")),
        (["id", "--bogus"], "murmur: error: unrecognized arguments: --bogus (murmur --help for the options)"),
    ],
)  # fmt: skip
def test_a_flag_error_is_one_line_with_where_to_look(args: list[str], line: str) -> None:
    done = _murmur(*args)
    assert done.returncode == 2
    assert done.stderr == line + "\n"


def test_version_comes_from_the_package_metadata() -> None:
    import murmur

    with (ROOT / "pyproject.toml").open("rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    assert murmur.__version__ == expected
    done = _murmur("--version")
    assert (done.returncode, done.stdout) == (0, f"murmur {expected}\n")


@pytest.mark.parametrize(("mode", "first_line"), [("--health", "healthy"), ("--json", "{"), (None, "peer ID")])
def test_status_does_not_import_torch(tmp_path: Path, mode: str | None, first_line: str) -> None:
    # A container's HEALTHCHECK runs it every few seconds, and beside a training node: torch would cost seconds
    # (under load) and a lot of memory.
    _write_status(tmp_path)
    argv = ["status", "--data-dir", str(tmp_path)] + ([mode] if mode else [])
    script = (
        "import sys\n"
        "from murmur.node.cli import main\n"
        f"code = main({argv!r})\n"
        "assert code == 0, code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(first_line), done.stdout[:200]


def _start_run(data_dir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(data_dir), "--listen", "/ip4/127.0.0.1/tcp/0",
            "--duration", "60"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.6, 1.5])
def test_ctrl_c_while_starting_exits_130_without_a_traceback(tmp_path: Path, delay: float) -> None:
    # Whatever the command is doing then (importing, loading the task, opening the host), the delay only picks the
    # moment. It counts from inside the `murmur` entry point, once it handles Ctrl-C (it prints "entry" from there):
    # a Ctrl-C while the interpreter starts, or before the entry point runs, is Python's to report.
    script = (
        "import sys; from murmur.node import cli; command = cli.main\n"
        "def main(argv): print('entry', flush=True); return command(argv)\n"
        f"cli.main = main; sys.argv = ['murmur', 'run', '--data-dir', {str(tmp_path)!r}, '--listen', '/ip4/127.0.0.1/tcp/0', "
        "'--duration', '60']; cli.entry()"
    )
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert run.stdout.readline() == "entry\n"
    time.sleep(delay)
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=60)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert run.returncode == 130, output


def test_ctrl_c_stops_a_running_node_gracefully_with_status_130(tmp_path: Path) -> None:
    run = _start_run(tmp_path)
    while not (line := run.stdout.readline()).startswith("murmur: listening on "):
        assert line, "murmur run ended before it listened"
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=60)
    assert "Traceback" not in output, output
    assert run.returncode == 130  # a script's `murmur run … && next` must not go on after Ctrl-C
    assert list((tmp_path / "checkpoints").glob("checkpoint-*.pt"))  # stopped gracefully: its work is saved
