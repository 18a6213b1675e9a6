"""The batch progress line: rows done, audio seconds made per wall second, ETA; and the summary."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO

STAGES = ("frontend", "llm", "flow_vocoder", "write")
SOME_STAGES = ("align",)  # only rows with captions have it; said where any row did


def _clock(s: float) -> str:
    s = int(max(0.0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class BatchProgress:
    """Counts results as they arrive. On a terminal one line is redrawn in place; otherwise a line
    is printed every ``interval`` seconds (logs stay readable)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, interval: float = 10.0):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and total > 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.start = time.perf_counter()
        self._last = self.start
        self.ok = self.failed = 0
        self.audio_seconds = 0.0
        self.tokens = 0
        self.stage_seconds = dict.fromkeys(STAGES + SOME_STAGES, 0.0)
        self.captioned = self.word_level = 0  # rows with caption files; of them, with word times
        self.words_why: set[str] = set()  # why the others have sentence times only
        self.normalized = self.held = 0  # rows with a loudness target; samples of them held at the ceiling
        self.gain_db = (0.0, 0.0)  # the lowest and highest gain they got, dB
        self.bad_takes = self.rows_with_bad_takes = 0  # caught takes (docs/retries.md), and the rows they were in
        self.take_actions: Counter[str] = Counter()  # what was done with them: retried, cut, kept

    def restart_clock(self) -> None:
        """Count time from now (after the model is loaded)."""
        self.start = self._last = time.perf_counter()

    @property
    def done(self) -> int:
        return self.ok + self.failed

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, rec: dict) -> None:
        if rec.get("status") == "ok":
            self.ok += 1
            self.audio_seconds += rec.get("audio_seconds", 0.0)
            self.tokens += rec.get("tokens", 0)
            for k in STAGES + SOME_STAGES:
                self.stage_seconds[k] += rec.get("seconds", {}).get(k, 0.0)
            if rec.get("captions"):
                self.captioned += 1
                self.word_level += rec.get("caption_level") == "word"
                self.words_why.update(rec.get("words_why") or ())
            if rec.get("retries"):
                self.rows_with_bad_takes += 1
                self.bad_takes += len(rec["retries"])
                self.take_actions.update(b.get("action") for b in rec["retries"])
            if rec.get("loudness_gain_db") is not None:
                g = rec["loudness_gain_db"]
                self.gain_db = (min(self.gain_db[0], g), max(self.gain_db[1], g)) if self.normalized else (g, g)
                self.normalized += 1
                self.held += rec.get("loudness_held", 0)
        else:
            self.failed += 1
        now = time.perf_counter()
        if self.enabled and (self.tty or now - self._last >= self.interval or self.done == self.total):
            self._last = now
            self._show()

    def line(self) -> str:
        el = self.elapsed
        rate = self.audio_seconds / el if el > 0 else 0.0
        left = self.total - self.done
        eta = _clock(el / self.done * left) if self.done else "?"
        failed = f" ({self.failed} failed)" if self.failed else ""
        return (f"batch: {self.done}/{self.total} rows{failed} | {self.audio_seconds:.1f} s audio, "
                f"{rate:.2f} audio-s/s | {_clock(el)} elapsed, ETA {eta}")

    def _show(self) -> None:
        if self.tty:
            end = "\n" if self.done == self.total else ""
            print("\r\x1b[2K" + self.line(), end=end, file=self.stream, flush=True)
        else:
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty and self.done != self.total:
            print(file=self.stream, flush=True)
