"""The `murmur` command's process behaviour: stop signals end it cleanly, never with a signal."""

import subprocess
import sys
from pathlib import Path


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
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout


