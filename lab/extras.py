"""What the lab needs beyond Murmur's own dependencies: checked before a run, not found missing after it."""

from __future__ import annotations

import importlib.util

LAB_EXTRA = 'pip install -e ".[lab]"'


def plotting_unavailable_reason() -> str | None:
    """None when matplotlib can be imported (every lab run ends with plots); else one line naming the fix."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"its plots need matplotlib, which the lab's extra installs: {LAB_EXTRA}"
    return None
