"""The pipeline's loudness stage (``SynthesisOptions.loudness``, docs/loudness.md): the chunks of one call
scaled by one gain, fixed where the call's audio allows it. The measurements and the gain rule are
:mod:`cosyllama.loudness`; this module decides what a gain is computed from and when it is known.

* Non-streamed: the whole output is measured first (every segment's chunk waits for the last).
* Streamed, the gain is fixed before the first chunk is yielded and every chunk gets it (nothing pumps): from
  the loudness of the voice's last finished output (:meth:`Token2Wav.voice_level
  <cosyllama.engine.Token2Wav.voice_level>`), or, before the voice has one, from the stream's own first
  sentence, held back until it is whole; from the prompt as the model renders it when that sentence is too
  short or silent to measure.

Every finished output's loudness before the gain is kept as its voice's next expectation
(:meth:`Token2Wav.note_output_level <cosyllama.engine.Token2Wav.note_output_level>`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np

from . import loudness
from .engine import AudioChunk, FlowPrompt, Token2Wav
from .request import SynthesisOptions
from .synthesis import Timings

log = logging.getLogger("cosyllama")

__all__ = ["even_loudness"]


def even_loudness(chunks: Iterator[AudioChunk], opts: SynthesisOptions, timings: Timings, prompt: FlowPrompt | None,
                  token2wav: Token2Wav, flow_work: Callable[[], AbstractContextManager[None]]) -> Iterator[AudioChunk]:
    """``chunks`` scaled by one gain to ``opts.loudness``; ``prompt``: the voice's flow conditioning (None: no
    voice to learn a level for); ``flow_work``: held around a vocoder pass over the prompt (the pipeline's flow
    slot). The gain and what it came from are written to ``timings`` before the first chunk is yielded."""
    stage = _Stage(opts.loudness, timings, prompt, token2wav, flow_work)
    try:
        yield from (stage.whole(chunks) if not opts.stream else stage.stream(chunks))
    finally:
        chunks.close()


class _Stage:
    def __init__(self, target: float, timings: Timings, prompt: FlowPrompt | None, token2wav: Token2Wav,
                 flow_work: Callable[[], AbstractContextManager[None]]):
        self.target, self.timings, self.prompt, self.token2wav = target, timings, prompt, token2wav
        self.flow_work = flow_work
        self.sample_rate = token2wav.sample_rate
        self.gain: loudness.Gain | None = None
        self.raw: list[np.ndarray] = []  # a stream's chunks before the gain: its loudness, kept when it ends

    def whole(self, chunks: Iterator[AudioChunk]) -> Iterator[AudioChunk]:
        parts = list(chunks)
        whole = np.concatenate([c.samples for c in parts]) if parts else np.zeros(0, np.float32)
        level = loudness.Level.of(whole, self.sample_rate)
        if self.prompt is not None:
            self.token2wav.note_output_level(self.prompt, level)
        self._fix(level, "output")
        yield from self._scaled(parts)

    def stream(self, chunks: Iterator[AudioChunk]) -> Iterator[AudioChunk]:
        # a voice with no finished output yet: its first sentence is held back until it is whole
        held_back: list[AudioChunk] | None = None
        if self.prompt is not None and not self.token2wav.known_output_level(self.prompt):
            held_back = []
        for c in chunks:
            if held_back is None:
                if self.gain is None:
                    self._fix(*self._expected())
                yield from self._scaled([c])
                continue
            held_back.append(c)
            if c.is_final:
                self._from_first_sentence(held_back)
                yield from self._scaled(held_back)
                held_back = None
        if held_back:  # the chunks ended inside the first sentence: what there is, measured as one
            self._from_first_sentence(held_back)
            yield from self._scaled(held_back)
        if self.prompt is not None and self.raw:  # the stream ended: its loudness is the voice's next expectation
            self.token2wav.note_output_level(self.prompt, loudness.Level.of(np.concatenate(self.raw), self.sample_rate))

    def _expected(self) -> tuple[loudness.Level, str]:
        if self.prompt is None:
            return loudness.Level(None, 0.0), "none"
        with self.flow_work():
            return self.token2wav.voice_level(self.prompt)

    def _from_first_sentence(self, parts: list[AudioChunk]) -> None:
        level = loudness.Level.of(np.concatenate([h.samples for h in parts]), self.sample_rate)
        if level.lufs is None or level.lufs == -math.inf:  # too short or silent to say: the prompt's level
            self._fix(*self._expected())
        else:
            self._fix(level, "sentence")

    def _fix(self, level: loudness.Level, source: str) -> None:
        gain = self.gain = loudness.gain_for(level, self.target)
        t = self.timings
        t.loudness_gain_db, t.loudness_why = gain.db, gain.why
        t.loudness_measured, t.loudness_from = level.lufs, source
        log.debug("loudness gain %.2f dB (%s; %s measured %s LUFS)", gain.db, gain.why, source, level.lufs)

    def _scaled(self, parts: list[AudioChunk]) -> Iterator[AudioChunk]:
        for c in parts:
            self.raw.append(c.samples)
            samples, held = loudness.apply(c.samples, self.gain.factor)
            self.timings.loudness_held += held
            yield replace(c, samples=samples)
