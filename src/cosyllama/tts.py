"""The native Python API: :func:`load` returns a :class:`TTS` with one method per mode, each a
generator of :class:`~cosyllama.engine.AudioChunk`.

>>> tts = cosyllama.load("Fun-CosyVoice3-0.5B", llm="llamacpp", gguf="cv3-speech-q8_0.gguf")
>>> voice = tts.make_voice("prompt.wav", "Transcript of the prompt.")
>>> audio = np.concatenate([c.samples for c in tts.zero_shot("Hello there!", voice=voice)])

A :class:`TTS` holds only read-only models; every call keeps its state in its own generator, so
calls may run from several threads or be interleaved.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .audio import AudioSource
from .config import load_config
from .defaults import LLM_CHOICES
from .device import resolve_device
from .engine import AudioChunk, FlowPrompt, Token2Wav, no_turn
from .flow import Flow
from .frontend import Frontend, ModelInput, PromptFeatures
from .limits import RequestLimits
from .llm.backend import LLMBackend, Prefill
from .llm.decode import MAX_LEN_RATIO, DecodeOptions, DirectTokens, SilentTokenFilter
from .llm.factory import choose_llm, make_llm, make_token_source
from .options import LoadOptions
from .request import FRONTEND_MODES, MODES, SynthesisOptions, SynthesisRequest, check_mode, check_options, resolve_mode
from .vocoder import HiFT
from .voices import VoiceStore

__all__ = ["LLM_CHOICES", "MODES", "DirectTokens", "Synthesis", "SynthesisOptions", "SynthesisRequest", "TTS",
           "Timings", "choose_mode", "load"]


@dataclass
class Timings:
    """Wall seconds per stage of the last finished call (filled by the generator as it runs)."""

    frontend: float = 0.0
    llm: float = 0.0
    token2wav: float = 0.0
    audio_seconds: float = 0.0
    first_chunk: float | None = None
    tokens: list[list[int]] = field(default_factory=list)


class Synthesis(Iterator[AudioChunk]):
    """The audio of one call, chunk by chunk. ``timings`` is complete once iteration ends."""

    def __init__(self, chunks: Iterator[AudioChunk], timings: Timings, cancel=None):
        self._chunks, self.timings, self._cancel = chunks, timings, cancel

    def __next__(self) -> AudioChunk:
        with self._cancel.bound() if self._cancel is not None else nullcontext():
            return next(self._chunks)

    def close(self) -> None:
        """Stop early; the LLM sequence is released at once."""
        self._chunks.close()

    def audio(self) -> np.ndarray:
        """Run to the end and return all samples concatenated (float32, 24 kHz)."""
        parts = list(self)
        return np.concatenate([c.samples for c in parts]) if parts else np.zeros(0, np.float32)


def _timed(it: Iterator, acc: list[float]) -> Iterator:
    """Yield from ``it``, adding the time spent inside ``next`` to ``acc[0]``."""
    while True:
        t0 = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            acc[0] += time.perf_counter() - t0
            return
        acc[0] += time.perf_counter() - t0
        yield x


def choose_mode(mode: str | None = None, instruction: str | None = None, has_transcript: bool = False) -> str:
    """The synthesis mode (one of :data:`MODES`): ``mode`` when given, else instruct with an
    instruction, zero-shot with a prompt transcript, cross-lingual without one (the rule of
    :meth:`SynthesisRequest.resolve`, which a synthesis applies itself)."""
    check_mode(mode)
    if mode is not None:
        return mode
    return resolve_mode(None, instruction, prompt_text=has_transcript, clip=True, voice_transcript=False,
                        voice_instruction=None)[0]


class TTS:
    """CosyVoice3 synthesis from an official model directory.

    ``TTS(options)`` with a :class:`~cosyllama.options.LoadOptions`, or ``TTS(model_dir, **fields)`` with
    the fields of :class:`~cosyllama.options.LoadOptions` as keywords (``TTS(options, **fields)``: those
    fields changed); see there for what each means: llm, gguf, llm_weights, device, n_gpu_layers,
    llm_precision, precision, threads, parallel, max_seq_tokens, limits, stream_cache_mb,
    prompt_cache_mb. ``llm_backend``: an LLM backend already built (tests, tools), used instead of
    building one from the options. What the streaming caches hold per frame and per voice: see
    docs/benchmarks.md#memory-of-the-streaming-caches.

    The model directory's config is read once, here; every stage is built from it.
    """

    def __init__(self, model_dir: str | Path | LoadOptions, *, llm_backend: LLMBackend | None = None, **options):
        self.options = opts = LoadOptions.of(model_dir, **options)
        if llm_backend is None:
            choose_llm(opts.llm, opts.gguf)  # refuse llama.cpp without a GGUF before loading anything
        self.device = resolve_device(opts.device)
        if opts.threads is not None:
            torch.set_num_threads(opts.threads)
        self.config = config = load_config(opts.model_dir)
        self.model_dir = config.model_dir
        self.sample_rate = config.sample_rate
        self.frontend = Frontend(config)
        self.llm = llm_backend if llm_backend is not None else make_llm(
            config, opts.llm, gguf=opts.gguf, llm_weights=opts.llm_weights, device=self.device, threads=opts.threads,
            n_gpu_layers=opts.n_gpu_layers, n_seq_max=opts.parallel, llm_precision=opts.llm_precision,
            max_seq_tokens=opts.max_seq_tokens)
        self.token2wav = Token2Wav.from_config(
            config, Flow.from_config(config, self.device, precision=opts.precision),
            HiFT.from_config(config, self.device, precision=opts.precision),
            stream_cache_mb=opts.stream_cache_mb, prompt_cache_mb=opts.prompt_cache_mb)
        self.token_source = make_token_source(self.llm)
        self.voices = VoiceStore()
        self.limits = opts.limits

    def with_token_source(self, token_source) -> TTS:
        """A view of this TTS (same models, same voices) whose LLM tokens come from
        ``token_source`` (e.g. the server's batching scheduler); this one is left as it is."""
        view = copy.copy(self)
        view.token_source = token_source
        return view

    def with_text_worker(self) -> TTS:
        """A view of this TTS whose frontend normalizes long texts in a helper process (see
        :meth:`~cosyllama.text.normalize.TextNormalizer.with_worker_process`; same text, but a long text no
        longer holds the GIL for seconds); ``view.frontend.normalizer.close_worker()`` ends it."""
        view = copy.copy(self)
        view.frontend = copy.copy(self.frontend)
        view.frontend.normalizer = self.frontend.normalizer.with_worker_process()
        return view

    def with_limits(self, limits: RequestLimits | None) -> TTS:
        """A view of this TTS (same models, same voices, same token source) checking every call
        against ``limits``; this one is left as it is."""
        view = copy.copy(self)
        view.limits = limits
        return view

    # -- voices ------------------------------------------------------------------------------------

    def make_voice(self, prompt_wav: AudioSource, prompt_text: str | None = None) -> PromptFeatures:
        """Prompt tokens, speaker embedding and prompt mel of a clip (16 kHz+, up to 30 s), once."""
        if self.limits is not None:
            self.limits.check_chars("transcript", prompt_text)
        voice = self.frontend.make_voice(prompt_wav, prompt_text)
        if self.limits is not None:
            self.limits.check_tokens("transcript", len(voice.prompt_text_ids))
        return voice

    def add_voice(self, voice_id: str, prompt_wav: AudioSource, prompt_text: str | None = None) -> PromptFeatures:
        """Register a voice under ``voice_id`` (replacing one of the same id)."""
        voice = self.make_voice(prompt_wav, prompt_text)
        self.voices.add(voice_id, voice)
        return voice

    def warm_voice(self, voice: PromptFeatures | str) -> bool:
        """Compute now the flow blocks streaming requests with this voice share (see
        ``prompt_cache_mb``), so that its first streaming request starts its first chunk after them
        too. Costs one flow solve over the prompt's frames; True if they are kept, False when the
        streaming caches are off or the prompt is too short to share a block. Not for voice
        conversion, whose prompt is aligned differently."""
        v = self.voices.get(voice) if isinstance(voice, str) else voice
        return self.token2wav.warm_prompt(self._to_flow_prompt(v.speech_tokens, v.prompt_feat, v.speaker_embedding))

    # -- modes: each builds a SynthesisRequest and runs it ----------------------------------------

    def zero_shot(self, text: str, prompt_wav: AudioSource | None = None, prompt_text: str | None = None, *,
                  voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                  **kw) -> Synthesis:
        """Clone the prompt's voice saying ``text``; the LLM continues the prompt's transcript."""
        return self.run(SynthesisRequest(text, "zero-shot", voice, prompt_wav, prompt_text,
                                         options=self._options(options, kw)))

    def cross_lingual(self, text: str, prompt_wav: AudioSource | None = None, *,
                      voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                      **kw) -> Synthesis:
        """Speak ``text`` (any language) in the prompt's voice, without its transcript."""
        return self.run(SynthesisRequest(text, "cross-lingual", voice, prompt_wav, options=self._options(options, kw)))

    def instruct(self, text: str, instruction: str | None, prompt_wav: AudioSource | None = None, *,
                 voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                 **kw) -> Synthesis:
        """Speak ``text`` in the prompt's voice following ``instruction`` (CosyVoice3 instruct2; None:
        the voice's own instruction)."""
        return self.run(SynthesisRequest(text, "instruct", voice, prompt_wav, instruction=instruction,
                                         options=self._options(options, kw)))

    def voice_conversion(self, source_wav: AudioSource, prompt_wav: AudioSource, *,
                         options: SynthesisOptions | None = None, **kw) -> Synthesis:
        """Re-render the speech of ``source_wav`` in the voice of ``prompt_wav`` (no LLM)."""
        opts = self._options(options, kw)
        check_options(opts)
        t0 = time.perf_counter()
        inp = self.frontend.vc(source_wav, prompt_wav)
        return self._run([inp], opts, time.perf_counter() - t0)

    def synthesize(self, text: str, *, mode: str | None = None, instruction: str | None = None,
                   voice: PromptFeatures | str | None = None, prompt_wav: AudioSource | None = None,
                   prompt_text: str | None = None, options: SynthesisOptions | None = None, **kw) -> Synthesis:
        """One of the three text modes, chosen as :meth:`SynthesisRequest.resolve` says when ``mode``
        is None: instruct with an ``instruction`` (or a voice that has one, e.g. from a voice folder's
        ``instruct.txt``: an ``instruction`` given replaces it), zero-shot when the voice (or
        ``prompt_text``) has a transcript, else cross-lingual."""
        return self.run(SynthesisRequest(text, mode, voice, prompt_wav, prompt_text, instruction,
                                         options=self._options(options, kw)))

    def run(self, request: SynthesisRequest, *, cancel=None) -> Synthesis:
        """Synthesize ``request`` (every front door comes through here): its voice looked up, its
        mode resolved (:meth:`SynthesisRequest.resolve`), the frontend's inputs made for that mode.
        ``cancel``: a :class:`~cosyllama.llm.scheduler.CancelToken` whose ``cancel()`` stops the
        synthesis and frees its LLM sequence at once (from any thread)."""
        r = request
        if self.limits is not None and r.limits != self.limits:  # checked once: against this TTS's limits
            r = replace(r, limits=self.limits)
        voice = self.voices.get(r.voice) if isinstance(r.voice, str) else r.voice
        mode, instruction = r.resolve(voice if r.prompt_wav is None else None)
        opts = r.options
        t0 = time.perf_counter()
        v = voice if voice is not None else r.prompt_wav
        how = {"text_frontend": opts.text_frontend, "russian_numbers": opts.russian_numbers}
        if mode == "zero-shot":
            inputs = self.frontend.zero_shot(r.text, v, r.prompt_text, **how)
        elif mode == "instruct":
            inputs = self.frontend.instruct2(r.text, instruction, v, **how)
        else:
            inputs = self.frontend.cross_lingual(r.text, v, **how)
        return self._run(inputs, opts, time.perf_counter() - t0, cancel=cancel)

    # -- the shared path ----------------------------------------------------------------------------

    def _options(self, options: SynthesisOptions | None, kw: dict) -> SynthesisOptions:
        opts = options or SynthesisOptions()
        if kw:
            unknown = set(kw) - set(SynthesisOptions.__dataclass_fields__)
            if unknown:
                raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; allowed: "
                                f"{', '.join(SynthesisOptions.__dataclass_fields__)}")
            opts = replace(opts, **kw)
        return opts

    def _flow_prompt(self, inp: ModelInput) -> FlowPrompt:
        tokens, feat = inp.flow_prompt_speech_tokens, inp.prompt_feat
        if inp.mode == "vc":
            # The reference leaves the VC prompt unaligned (see docs/reference.md#q10-unaligned-vc-prompt),
            # which shifts the boundary between prompt and converted speech; we align it like every other
            # mode.
            n = min(feat.shape[0] // self.config.token_mel_ratio, tokens.shape[0])
            tokens, feat = tokens[:n], feat[: n * self.config.token_mel_ratio]
        return self._to_flow_prompt(tokens, feat, inp.speaker_embedding)

    def _to_flow_prompt(self, tokens: torch.Tensor, feat: torch.Tensor, embedding: torch.Tensor) -> FlowPrompt:
        dev = self.device
        return FlowPrompt(tokens.reshape(1, -1).to(dev, torch.int32), feat.unsqueeze(0).to(dev, torch.float32),
                          embedding.reshape(1, -1).to(dev, torch.float32))

    def segment_tokens(self, inp: ModelInput, opts: SynthesisOptions, segment: int) -> Iterator[int]:
        """Speech tokens that reach the flow for one segment (silent-token filter applied)."""
        if inp.mode == "vc":
            yield from (int(t) for t in inp.source_speech_tokens.tolist())
            return
        prefill = Prefill(inp.llm_text_ids, tuple(int(t) for t in inp.llm_prompt_speech_tokens.tolist()))
        seed = None if opts.seed is None else opts.seed + segment
        dec = DecodeOptions(greedy=opts.greedy, seed=seed, max_len=opts.max_tokens, ignore_stop=opts.ignore_stop)
        flt = SilentTokenFilter()
        for tok in self.token_source.generate(prefill, len(inp.text_ids), dec):
            if flt.keep(tok):
                yield tok

    def _check_tokens(self, inputs: list[ModelInput], opts: SynthesisOptions) -> None:
        """Refuse, before any LLM work, inputs over the token limits or a segment whose sequence
        (prompt + the speech tokens it may decode) is over the per-sequence budget."""
        lim = self.limits
        if lim is None or not inputs or inputs[0].mode == "vc":
            return
        lim.check_tokens("input", sum(len(inp.text_ids) for inp in inputs))
        prompt_field = {FRONTEND_MODES["zero-shot"]: "transcript",
                        FRONTEND_MODES["instruct"]: "instructions"}.get(inputs[0].mode)
        if prompt_field is not None:
            lim.check_tokens(prompt_field, len(inputs[0].prompt_text_ids))
        for inp in inputs:
            n_prompt = 2 + len(inp.llm_text_ids) + len(inp.llm_prompt_speech_tokens)
            n_new = opts.max_tokens if opts.max_tokens is not None else MAX_LEN_RATIO * len(inp.text_ids)
            lim.check_sequence(n_prompt, n_new, inp.text)

    def _run(self, inputs: list[ModelInput], opts: SynthesisOptions, frontend_s: float, cancel=None) -> Synthesis:
        self._check_tokens(inputs, opts)
        timings = Timings(frontend=frontend_s)
        return Synthesis(self._generate(inputs, opts, timings), timings, cancel)

    def _generate(self, inputs: list[ModelInput], opts: SynthesisOptions, timings: Timings) -> Iterator[AudioChunk]:
        start = time.perf_counter()
        llm_acc = [0.0]
        turn = getattr(self.token_source, "flow_turn", no_turn)  # a batching scheduler may pause for the flow
        for i, inp in enumerate(inputs):
            if i == 1:  # only the first segment's first chunk is the request's first audio
                turn = _never_first(turn)
            prompt = self._flow_prompt(inp)
            tokens = _timed(self.segment_tokens(inp, opts, i), llm_acc)
            if opts.stream:
                for chunk in self.token2wav.stream(tokens, prompt, i, turn=turn):
                    timings.audio_seconds += chunk.samples.size / self.sample_rate
                    if timings.first_chunk is None and chunk.samples.size:
                        timings.first_chunk = time.perf_counter() - start + timings.frontend
                    if chunk.is_final:
                        timings.tokens.append(list(chunk.tokens))
                    yield chunk
            else:
                toks = list(tokens)
                samples = self.token2wav.full(toks, prompt, opts.speed, turn=turn)
                timings.tokens.append(toks)
                timings.audio_seconds += samples.size / self.sample_rate
                if timings.first_chunk is None:
                    timings.first_chunk = time.perf_counter() - start + timings.frontend
                yield AudioChunk(samples, self.sample_rate, i, True, tuple(toks))
        timings.llm = llm_acc[0]
        timings.token2wav = time.perf_counter() - start - timings.llm


def load(model_dir: str | Path | LoadOptions, **options) -> TTS:
    """Load a CosyVoice3 model directory: ``load(options)`` with a :class:`~cosyllama.options.LoadOptions`,
    or ``load(model_dir, **fields)`` with its fields as keywords; see :class:`TTS`."""
    return TTS(model_dir, **options)


def _never_first(turn):
    """``turn`` for the segments after the first: none of their chunks is the request's first audio."""
    def later(first: bool = False):
        return turn(first=False)
    return later
