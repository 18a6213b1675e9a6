"""Bad takes: a segment's speech tokens that loop or run away, caught as they are made (docs/retries.md).

* A *loop*: a stretch of the take equal to itself shifted by ``p`` tokens (1 <= p <= :data:`LOOP_MAX_PERIOD`),
  whose repeats after the first pass reach ``max((LOOP_MIN_REPEATS - 1) * p, LOOP_MIN_TOKENS)`` tokens: the
  pattern three times in a row and at least one second (25 tokens) of exact repetition. A pattern made only of
  silent tokens is not a loop (the silent-token filter already keeps long silences from the flow).
* A *runaway*: the take reached the reference's ``max_len`` (20 tokens per text token) without a stop id.
* A take cannot end before ``min_len``: every stop id is masked until then (docs/reference.md#full-min-length-mask).

:class:`Take` runs one attempt of a segment through the silent-token filter and the detector; the pipeline
(:mod:`cosyllama.tts`) retries a caught take with :func:`retry_seed`, or cuts a loop where it began.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from ..seeds import offset_seed
from .decode import SILENT_TOKENS, SilentTokenFilter

LOOP_MAX_PERIOD = 50  # tokens (2 s): the longest repeating stretch looked for
LOOP_MIN_REPEATS = 3  # the stretch at least this many times in a row
LOOP_MIN_TOKENS = 25  # and its repeats after the first pass at least this many tokens (1 s)
RETRY_SEED_STRIDE = 1 << 20  # attempt k of segment i: seed + i + k * stride (wrapped into the seed range)

REASONS = ("loop", "runaway")
ACTIONS = ("retried", "cut", "kept")


def loop_bound(period: int) -> int:
    """Repeated tokens (after the first pass of the pattern) at which a loop of ``period`` is caught."""
    return max((LOOP_MIN_REPEATS - 1) * period, LOOP_MIN_TOKENS)


def retry_seed(seed: int | None, segment: int, attempt: int) -> int | None:
    """The seed of ``attempt`` (0: the first take) of text segment ``segment``: ``seed + segment`` for the
    first take (the seed rule), ``seed + segment + attempt * 2**20`` after, wrapped into 0 .. 2**31 - 1
    (:func:`cosyllama.seeds.offset_seed`); None (fresh entropy) stays None."""
    return offset_seed(seed, segment + attempt * RETRY_SEED_STRIDE)


@dataclass(frozen=True)
class Loop:
    """A loop found at token ``end`` (exclusive): the pattern of ``period`` tokens starts at ``start``."""

    start: int
    period: int
    end: int

    @property
    def cut(self) -> int:
        """Where the take is cut: after the pattern's first pass."""
        return self.start + self.period


class LoopDetector:
    """Finds a loop in tokens pushed one by one: for each period p it keeps the length of the current run of
    tokens equal to the token p before (O(max_period) per token)."""

    def __init__(self, max_period: int = LOOP_MAX_PERIOD):
        self.max_period = max_period
        self.tokens: list[int] = []
        self._runs = [0] * (max_period + 1)
        self._bounds = [0] + [loop_bound(p) for p in range(1, max_period + 1)]

    def push(self, tok: int) -> Loop | None:
        toks, runs = self.tokens, self._runs
        toks.append(tok)
        n = len(toks)
        found = None
        for p in range(1, min(self.max_period, n - 1) + 1):
            if toks[n - 1 - p] != tok:
                runs[p] = 0
                continue
            runs[p] += 1
            if found is None and runs[p] >= self._bounds[p]:
                start = n - runs[p] - p
                if not all(t in SILENT_TOKENS for t in toks[start:start + p]):
                    found = Loop(start, p, n)
        return found


@dataclass(frozen=True)
class BadTake:
    """One caught take: its ``segment`` and ``attempt`` (0: the first), ``seed`` (None: fresh entropy),
    ``reason`` (loop | runaway), the speech tokens the LLM had made when it was caught (``tokens``), the loop's
    ``period`` and ``start`` (loops only), and what was done (``action``): retried (another take replaces it),
    cut (the take ends where its loop began: no retry left, greedy, or audio already sent), kept (as made:
    retries off, or a runaway with no retry left)."""

    segment: int
    attempt: int
    seed: int | None
    reason: str
    tokens: int
    action: str
    period: int | None = None
    start: int | None = None

    def describe(self) -> str:
        """One line, e.g. ``segment 0 take 1 (seed 42): loop of 12 tokens from token 40, caught at 76; retried``."""
        seed = "fresh seed" if self.seed is None else f"seed {self.seed}"
        if self.reason == "loop":
            what = f"loop of {self.period} tokens from token {self.start}, caught at {self.tokens}"
        else:
            what = f"runaway: {self.tokens} tokens without an end"
        return f"segment {self.segment} take {self.attempt} ({seed}): {what}; {self.action}"

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k == "seed"}


class RetryTake(Exception):
    """Raised from a :class:`Take`'s tokens when its take is caught and should be made again."""


class Take:
    """One attempt at a segment's speech tokens: iterating yields those that reach the flow (silent-token filter
    applied) and runs the detector on every token the LLM makes.

    ``tokens``: the LLM's tokens (closed when the take ends). ``max_len``: the take's ``max_len`` when reaching it
    means a runaway (None: not judged). ``act``: stop a loop (else only note it: retries off). ``retry``: on a
    caught take, raise :class:`RetryTake` while ``audio_out`` is false (the pipeline sets it once audio of the
    take has gone out); otherwise a loop ends the take, ``cut`` telling how many of the yielded tokens to keep."""

    def __init__(self, tokens: Iterator[int], *, max_len: int | None, act: bool, retry: bool,
                 detect: bool = True):
        self._tokens, self.max_len, self.act, self.retry, self.detect = tokens, max_len, act, retry, detect
        self.audio_out = False
        self.n = 0  # tokens the LLM made
        self.loop: Loop | None = None
        self.reason: str | None = None
        self.cut: int | None = None  # yielded tokens to keep (a loop cut), None: all

    @property
    def caught(self) -> bool:
        return self.reason is not None

    def cut_at(self) -> int | None:
        return self.cut

    def __iter__(self) -> Iterator[int]:
        flt = SilentTokenFilter()
        det = LoopDetector() if self.detect else None
        kept_before: list[int] = []  # yielded tokens before each LLM token
        kept = 0
        try:
            for tok in self._tokens:
                kept_before.append(kept)
                self.n += 1
                if det is not None and self.reason is None:
                    loop = det.push(tok)
                    if loop is not None:
                        self.loop, self.reason = loop, "loop"
                        if self.act:
                            if self.retry and not self.audio_out:
                                raise RetryTake
                            self.cut = kept_before[loop.cut]
                            return
                if flt.keep(tok):
                    kept += 1
                    yield tok
            if self.reason is None and self.max_len is not None and self.n >= self.max_len:
                self.reason = "runaway"
                if self.act and self.retry and not self.audio_out:
                    raise RetryTake
        finally:
            close: Callable[[], None] | None = getattr(self._tokens, "close", None)
            if close is not None:
                close()
