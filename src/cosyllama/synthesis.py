"""What one call of the pipeline gives back: a :class:`Synthesis` (its audio chunk by chunk, its segments and
words as they end) and its :class:`Timings` (where the time went, and what loudness and retries did)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .alignment import WordTimer
from .captions import Segment
from .engine import AudioChunk
from .llm.takes import BadTake

__all__ = ["CurrentWords", "Synthesis", "Timings", "timed"]


@dataclass
class Timings:
    """Wall seconds per stage of the last finished call (filled by the generator as it runs)."""

    frontend: float = 0.0
    llm: float = 0.0
    token2wav: float = 0.0
    audio_seconds: float = 0.0
    first_chunk: float | None = None
    align: float = 0.0  # word alignment (SynthesisOptions.word_times), after each segment's audio
    tokens: list[list[int]] = field(default_factory=list)
    # SynthesisOptions.loudness: the one gain applied (dB; set before the first chunk is yielded), why
    # ("target", "ceiling", "short", "silent"; cosyllama.loudness.Gain), the loudness it was computed from
    # (LUFS; None: too short to measure) and the samples a stream had to hold at the ceiling (its gain is fixed
    # before its later audio exists, which may peak higher)
    loudness_gain_db: float | None = None
    loudness_why: str | None = None
    loudness_measured: float | None = None
    loudness_held: int = 0
    # what loudness_measured is of: "output" (non-streamed: this output; a stream: its voice's last finished one),
    # "sentence" (a stream whose voice has no finished output yet: its own first sentence, held back until whole),
    # "prompt" (that first sentence too short or silent to measure: the prompt as the model renders it)
    loudness_from: str | None = None
    # every caught take (a loop or a runaway) in the order caught, each with what was done (docs/retries.md);
    # a segment's entries are in before its final chunk is yielded
    retries: list[BadTake] = field(default_factory=list)


class Synthesis(Iterator[AudioChunk]):
    """The audio of one call, chunk by chunk. ``timings`` is complete once iteration ends. ``segments``: one
    :class:`~cosyllama.captions.Segment` per text segment whose audio has ended (its text and its place in the
    output to the sample), filled as iteration goes; each chunk's ``start`` is its place in the output.

    With ``word_times``, a segment's words are aligned after its final chunk has been yielded: when iteration
    resumes, or at once by :meth:`finish_words` (a server sends them before it waits for the next audio)."""

    def __init__(self, chunks: Iterator[AudioChunk], timings: Timings, segments: list[Segment] | None = None,
                 words: WordTimer | None = None):
        self._chunks, self.timings = chunks, timings
        self.segments: list[Segment] = segments if segments is not None else []
        self._words = words

    def finish_words(self) -> None:
        """Align now every segment whose audio has ended and whose words are not made yet (word_times)."""
        if self._words is not None:
            self._words.finish()

    def __next__(self) -> AudioChunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop early; the LLM sequence is released at once."""
        self._chunks.close()

    def audio(self) -> np.ndarray:
        """Run to the end and return all samples concatenated (float32, 24 kHz)."""
        parts = list(self)
        return np.concatenate([c.samples for c in parts]) if parts else np.zeros(0, np.float32)


class CurrentWords:
    """``Synthesis.finish_words`` of a dialogue: the running turn's, then its segments placed again."""

    def __init__(self, current: list):
        self._current = current

    def finish(self) -> None:
        for syn, place in list(self._current):
            syn.finish_words()
            place()


def timed(it: Iterator, acc: list[float]) -> Iterator:
    """Yield from ``it``, adding the time spent inside ``next`` to ``acc[0]``."""
    while True:
        t0 = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            return
        finally:
            acc[0] += time.perf_counter() - t0
        yield x
