"""What the lab needs beyond Murmur's own dependencies: checked before a run, not found missing after it."""

from __future__ import annotations

import importlib.util
import sys

LAB_EXTRA = 'pip install -e ".[lab]"'


def plotting_unavailable_reason() -> str | None:
    """None when matplotlib can be imported (every lab run ends with plots); else one line naming the fix."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"its plots need matplotlib, which the lab's extra installs: {LAB_EXTRA}"
    return None


def plotting_missing(command: str) -> bool:
    """True, having said the fix on stderr as `COMMAND: error: …`, if matplotlib cannot be imported; else False."""
    reason = plotting_unavailable_reason()
    if reason is not None:
        print(f"{command}: error: {reason}", file=sys.stderr)
    return reason is not None
