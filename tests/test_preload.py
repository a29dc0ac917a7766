"""The fork server's preload: everything a forked peer or sync rank needs, imported once and frozen."""

import subprocess
import sys

CHECK = """
import gc, sys
before = gc.get_freeze_count()
import lab.preload
print(before, gc.get_freeze_count(), *(m in sys.modules for m in ("torch._dynamo", "murmur.node.ops.run", "murmur.node.ops.node", "murmur.node.learn.tasks.charlm")))
"""


def test_preloading_imports_the_node_and_freezes_what_it_loaded() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True)
    before, after, *loaded = done.stdout.split()
    assert int(before) == 0 and int(after) > 10_000  # forked children do not rescan the inherited heap
    assert loaded == ["True"] * 4
