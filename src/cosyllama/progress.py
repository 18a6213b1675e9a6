"""Progress reporting shared by the commands: line reporters and the stage-counter adapter."""

from __future__ import annotations

import sys
from collections.abc import Callable

LineProgress = Callable[[str], None]  # one human-readable line per call
StageProgress = Callable[[str, int, int], None]  # (stage, done, total), e.g. from the GGUF converter


def to_stderr(msg: str) -> None:
    """Print a progress line on stderr (stdout stays for results)."""
    print(msg, file=sys.stderr, flush=True)


def counting_progress(report: LineProgress = to_stderr) -> StageProgress:
    """Adapter for ``progress(stage, done, total)`` callbacks: one line per stage at 0/25/50/75/100 %."""
    shown: dict[str, int] = {}

    def cb(stage: str, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        step = pct // 25 * 25
        if shown.get(stage, -1) < step:
            shown[stage] = step
            report(f"  {stage}: {done}/{total} ({step} %)")

    return cb
