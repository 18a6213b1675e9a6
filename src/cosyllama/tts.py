"""The native Python API: :func:`load` returns a :class:`TTS` with one method per mode, each a
generator of :class:`~cosyllama.engine.AudioChunk`.

>>> tts = cosyllama.load("Fun-CosyVoice3-0.5B", llm="llamacpp", gguf="cv3-speech-q8_0.gguf")
>>> voice = tts.make_voice("prompt.wav", "Transcript of the prompt.")
>>> audio = np.concatenate([c.samples for c in tts.zero_shot("Hello there!", voice=voice)])

A :class:`TTS` is a cheap pipeline over loaded, read-only :class:`~cosyllama.models.Models` (its own token
source, limits, voices, text worker and flow-slot limit); every call keeps its state in its own generator, so
calls may run from several threads or be interleaved. Several pipelines may share one set of models
(:meth:`TTS.from_models`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .alignment import WordTimer
from .audio import AudioSource
from .captions import Segment, spoken_text
from .config import ModelConfig
from .defaults import LLM_CHOICES
from .engine import AudioChunk, FlowPause, FlowPrompt, Token2Wav
from .frontend import Frontend, ModelInput, PromptFeatures
from .limits import RequestLimits
from .llm.backend import LLMBackend, Prefill
from .llm.decode import MAX_LEN_RATIO, CancelToken, DecodeOptions, DirectTokens, SilentTokenFilter, TokenSource
from .llm.factory import make_token_source
from .llm.takes import BadTake, RetryTake, Take, retry_seed
from .loudness_stage import even_loudness
from .models import Models
from .openmp import gives_team_back, release_thread_team
from .options import LoadOptions
from .request import FRONTEND_MODES, MODES, SynthesisOptions, SynthesisRequest, check_mode, check_options, resolve_mode
from .seeds import offset_seed
from .synthesis import CurrentWords, Synthesis, Timings, timed
from .text.lexicon import Lexicon
from .text.normalize import TextNormalizer
from .voices import VoiceStore

log = logging.getLogger("cosyllama")

__all__ = ["LLM_CHOICES", "MODES", "DirectTokens", "Synthesis", "SynthesisOptions", "SynthesisRequest", "TTS",
           "Timings", "choose_mode", "load"]


def _shown(inp: ModelInput) -> str:
    """What captions show of a segment: its shown text (inline forms as words, no lexicon tokens) where the
    frontend made one, else its LLM text."""
    return inp.shown if inp.shown is not None else inp.text


def choose_mode(mode: str | None = None, instruction: str | None = None, has_transcript: bool = False) -> str:
    """The synthesis mode (one of :data:`MODES`): ``mode`` when given, else instruct with an
    instruction, zero-shot with a prompt transcript, cross-lingual without one (the rule of
    :meth:`SynthesisRequest.resolve`, which a synthesis applies itself)."""
    check_mode(mode)
    if mode is not None:
        return mode
    return resolve_mode(None, instruction, prompt_text=has_transcript, clip=True, voice_transcript=False,
                        voice_instruction=None)[0]


_FROM_OPTIONS = object()  # TTS.from_models: the limits the models were loaded with


def merge_lexicons(*lexicons: Lexicon | None) -> Lexicon | None:
    """The lexicons given (None ones skipped) as one, a later one's entries winning where two have a word:
    a call's lexicon is ``merge_lexicons(TTS.lexicon, voice.lexicon, options.lexicon)``."""
    out = None
    for lex in lexicons:
        if lex is not None:
            out = lex if out is None else out | lex
    return out


class TTS:
    """CosyVoice3 synthesis from an official model directory: a pipeline over loaded
    :class:`~cosyllama.models.Models`.

    ``TTS(options)`` with a :class:`~cosyllama.options.LoadOptions`, or ``TTS(model_dir, **fields)`` with
    the fields of :class:`~cosyllama.options.LoadOptions` as keywords (``TTS(options, **fields)``: those
    fields changed); see there for what each means: llm, gguf, llm_weights, device, n_gpu_layers,
    llm_precision, precision, threads, parallel, max_seq_tokens, limits, stream_cache_mb,
    prompt_cache_mb. ``llm_backend``: an LLM backend already built (tests, tools), used instead of
    building one from the options. What the streaming caches hold per frame and per voice: see
    docs/benchmarks.md#memory-of-the-streaming-caches. This loads the models (:meth:`Models.load
    <cosyllama.models.Models.load>`), then builds the pipeline Python calls get: each request decodes
    alone, the options' limits, an empty voice store. :meth:`from_models` builds another pipeline over
    models already loaded (a server's, batch's).

    The models (``models``, and as attributes ``config``, ``device``, ``sample_rate``, ``frontend``,
    ``llm``, ``token2wav``, ``options``) are shared and read-only; ``token_source``, ``limits``,
    ``voices``, ``normalizer`` and ``flow_slots`` are this pipeline's.
    """

    def __init__(self, model_dir: str | Path | LoadOptions, *, llm_backend: LLMBackend | None = None, **options):
        models = Models.load(LoadOptions.of(model_dir, **options), llm_backend=llm_backend)
        self._build(models, make_token_source(models.llm), models.options.limits, VoiceStore(), None, 0)

    @classmethod
    def load(cls, model_dir: str | Path | LoadOptions, **options) -> TTS:
        """``TTS(model_dir, **options)``: :meth:`Models.load <cosyllama.models.Models.load>` (the one loader),
        then the Python API's pipeline over the models."""
        return cls(model_dir, **options)

    @classmethod
    def from_models(cls, models: Models, *, token_source: TokenSource | None = None,
                    limits: RequestLimits | None = _FROM_OPTIONS, voices: VoiceStore | None = None,
                    text_worker: bool = False, flow_slots: int = 0, lexicon: Lexicon | None = None) -> TTS:
        """A pipeline over ``models`` (nothing is loaded or copied; the models are shared):

        * ``token_source``: where its speech tokens come from (a :class:`~cosyllama.llm.decode.TokenSource`
          from :func:`~cosyllama.llm.factory.make_token_source`, e.g. a server's batching scheduler, which
          its maker closes); None: each request decodes alone (:class:`~cosyllama.llm.decode.DirectTokens`);
        * ``limits``: every call is checked against these :class:`~cosyllama.limits.RequestLimits`
          (default: ``models.options.limits``; None: no limits);
        * ``voices``: the voice store its ``voice="id"`` calls read (default: a new, empty one);
        * ``text_worker``: normalize long texts in a helper process, started now (same text, but a long
          text no longer holds the GIL for seconds; :meth:`close` ends it);
        * ``flow_slots``: at most this many of its calls run the flow and vocoder at once (the rest keep
          decoding; on a few CPU cores concurrent flows only split the same cores); 0: no limit;
        * ``lexicon``: words every call speaks as their pronunciation tokens (``TTS.lexicon``; a call's
          ``SynthesisOptions.lexicon`` adds to it, its entries winning).
        """
        if flow_slots < 0:
            raise ValueError(f"flow_slots must be >= 0, got {flow_slots}")
        tts = cls.__new__(cls)
        normalizer = models.frontend.normalizer.with_worker_process() if text_worker else None
        tts._build(models, token_source if token_source is not None else make_token_source(models.llm),
                   models.options.limits if limits is _FROM_OPTIONS else limits,
                   voices if voices is not None else VoiceStore(), normalizer, flow_slots)
        tts.lexicon = lexicon
        return tts

    def _build(self, models: Models, token_source: TokenSource, limits: RequestLimits | None, voices: VoiceStore,
               normalizer: TextNormalizer | None, flow_slots: int) -> None:
        self.models = models  # shared, read-only
        self.token_source = token_source  # speech tokens: DirectTokens or a BatchScheduler (its maker closes it)
        self.limits = limits  # checked on every call; None: none
        self.voices = voices  # what voice="id" reads
        # text normalization of this pipeline's calls: the frontend's, or one with a helper process (close())
        self.normalizer = normalizer if normalizer is not None else models.frontend.normalizer
        self._own_normalizer = normalizer is not None
        # words every call speaks as their pronunciation tokens (a voice's lexicon, then a call's options.lexicon,
        # add to it, each winning over the one before); None: none
        self.lexicon: Lexicon | None = None
        self.flow_slots = flow_slots  # calls in the flow + vocoder at once; 0: no limit
        self._flow_sem = threading.Semaphore(flow_slots) if flow_slots > 0 else None

    def close(self) -> None:
        """End the text helper process this pipeline started (if any); the models and the token source
        are not this pipeline's to close."""
        if self._own_normalizer:
            self.normalizer.close_worker()

    # -- the shared models, read-only ----------------------------------------------------------------

    @property
    def options(self) -> LoadOptions:
        return self.models.options

    @property
    def config(self) -> ModelConfig:
        return self.models.config

    @property
    def model_dir(self) -> Path:
        return self.models.config.model_dir

    @property
    def device(self) -> torch.device:
        return self.models.device

    @property
    def sample_rate(self) -> int:
        return self.models.sample_rate

    @property
    def frontend(self) -> Frontend:
        return self.models.frontend

    @property
    def llm(self) -> LLMBackend:
        return self.models.llm

    @property
    def token2wav(self) -> Token2Wav:
        return self.models.token2wav

    # -- voices ------------------------------------------------------------------------------------

    @gives_team_back  # made here, used on other threads maybe (cosyllama.openmp)
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

    @gives_team_back  # made here, used on other threads maybe (cosyllama.openmp)
    def warm_voice(self, voice: PromptFeatures | str, low_latency: bool = False) -> bool:
        """Compute now the flow blocks streaming requests with this voice share (see
        ``prompt_cache_mb``), so that its first streaming request starts its first chunk after them
        too; ``low_latency``: all the prompt's frames, which a low-latency first chunk
        (``first_chunk_tokens``) starts from. Costs one flow solve over the prompt's frames; True if
        they are kept, False when the streaming caches are off or the prompt is too short to share a
        block. Not for voice conversion, whose prompt is aligned differently."""
        v = self.voices.get(voice) if isinstance(voice, str) else voice
        return self.token2wav.warm_prompt(self._to_flow_prompt(v.speech_tokens, v.prompt_feat, v.speaker_embedding),
                                          whole=low_latency)

    # -- modes: each builds a SynthesisRequest and runs it ----------------------------------------

    def zero_shot(self, text: str, prompt_wav: AudioSource | None = None, prompt_text: str | None = None, *,
                  voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                  cancel: CancelToken | None = None, **kw) -> Synthesis:
        """Clone the prompt's voice saying ``text``; the LLM continues the prompt's transcript."""
        return self.run(SynthesisRequest(text, "zero-shot", voice, prompt_wav, prompt_text,
                                         options=self._options(options, kw)), cancel=cancel)

    def cross_lingual(self, text: str, prompt_wav: AudioSource | None = None, *,
                      voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                      cancel: CancelToken | None = None, **kw) -> Synthesis:
        """Speak ``text`` (any language) in the prompt's voice, without its transcript."""
        return self.run(SynthesisRequest(text, "cross-lingual", voice, prompt_wav, options=self._options(options, kw)),
                        cancel=cancel)

    def instruct(self, text: str, instruction: str | None, prompt_wav: AudioSource | None = None, *,
                 voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                 cancel: CancelToken | None = None, **kw) -> Synthesis:
        """Speak ``text`` in the prompt's voice following ``instruction`` (CosyVoice3 instruct2; None:
        the voice's own instruction)."""
        return self.run(SynthesisRequest(text, "instruct", voice, prompt_wav, instruction=instruction,
                                         options=self._options(options, kw)), cancel=cancel)

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
                   prompt_text: str | None = None, options: SynthesisOptions | None = None,
                   cancel: CancelToken | None = None, **kw) -> Synthesis:
        """One of the three text modes, chosen as :meth:`SynthesisRequest.resolve` says when ``mode``
        is None: instruct with an ``instruction`` (or a voice that has one, e.g. from a voice folder's
        ``instruct.txt``: an ``instruction`` given replaces it), zero-shot when the voice (or
        ``prompt_text``) has a transcript, else cross-lingual."""
        return self.run(SynthesisRequest(text, mode, voice, prompt_wav, prompt_text, instruction,
                                         options=self._options(options, kw)), cancel=cancel)

    def dialogue(self, turns, *, pause: float = 0.0, options: SynthesisOptions | None = None,
                 cancel: CancelToken | None = None, **kw) -> Synthesis:
        """Speak a script of :class:`~cosyllama.dialogue.Turn` (each its voice: a registered id or
        :class:`PromptFeatures`, its text, instruction, speed) as one output, ``pause`` seconds of silence
        between turns (exactly ``round(pause * sample_rate)`` samples), each turn run when the one before it
        ends (:mod:`cosyllama.dialogue`: the seed rule, captions naming the speaker). ``options`` (and
        ``**kw``) apply to every turn. Every turn is checked, and every voice looked up, before any audio: a
        bad turn is a :class:`~cosyllama.dialogue.ScriptError` naming it."""
        from .dialogue import check_turns, turn_requests

        opts = self._options(options, kw)
        turns = list(turns)
        check_turns(turns, pause)
        requests = turn_requests(turns, opts, self.limits, self.voices)
        return self.run_turns(requests, [t.speaker for t in turns], pause, cancel=cancel)

    def ssml(self, document: str, voice: PromptFeatures | str, *, options: SynthesisOptions | None = None,
             cancel: CancelToken | None = None, **kw) -> Synthesis:
        """Speak an SSML ``<speak>`` document (the subset of docs/pronunciation.md) in ``voice`` (a registered id
        or :class:`PromptFeatures`; ``<voice name>`` switches to a registered voice): its spans are the turns of
        a :meth:`dialogue` (a ``<p>``/``<s>`` or a change of voice or rate starts a new one), its breaks exact
        silences. Raises :class:`~cosyllama.text.ssml.SsmlError` for a document that cannot be used."""
        from .dialogue import check_turns, ssml_turns, turn_requests
        from .text.ssml import parse_ssml

        opts = self._options(options, kw)
        doc = parse_ssml(document, self.frontend.tokenizer)
        turns, silences = ssml_turns(doc, voice)
        check_turns(turns, 0.0)
        requests = turn_requests(turns, opts, self.limits, self.voices)
        return self.run_turns(requests, [t.speaker for t in turns], silences, cancel=cancel)

    def run_turns(self, requests: list[SynthesisRequest], speakers: list[str | None], pause, *,
                  cancel: CancelToken | None = None) -> Synthesis:
        """:meth:`dialogue` of requests already made and checked (a server's turns, each with its voice's
        features): ``speakers`` name each turn's speaker in its segments; ``pause`` is the seconds between turns,
        or every gap (:func:`cosyllama.dialogue.gaps`)."""
        from .dialogue import dialogue_chunks

        timings, segments, current = Timings(), [], []
        chunks = dialogue_chunks(self, speakers, requests, pause, timings, segments, current, cancel)
        word_times = any(r.options.word_times for r in requests)
        return Synthesis(chunks, timings, segments, CurrentWords(current) if word_times else None)

    def run(self, request: SynthesisRequest, *, cancel: CancelToken | None = None) -> Synthesis:
        """Synthesize ``request`` (every front door comes through here): its voice looked up, its
        mode resolved (:meth:`SynthesisRequest.resolve`), the frontend's inputs made for that mode.
        ``cancel``: a :class:`~cosyllama.llm.decode.CancelToken` whose ``cancel()`` stops the
        synthesis and frees its LLM sequence at once (from any thread; the synthesis then raises
        ``RequestCancelled``)."""
        r = request
        if self.limits is not None and r.limits != self.limits:  # checked once: against this TTS's limits
            r = replace(r, limits=self.limits)
        voice = self.voices.get(r.voice) if isinstance(r.voice, str) else r.voice
        mode, instruction = r.resolve(voice if r.prompt_wav is None else None)
        opts = r.options
        t0 = time.perf_counter()
        v = voice if voice is not None else r.prompt_wav
        lexicon = merge_lexicons(self.lexicon, getattr(voice, "lexicon", None), opts.lexicon)
        how = {"text_frontend": opts.text_frontend, "russian_numbers": opts.russian_numbers,
               "normalizer": self.normalizer, "lexicon": lexicon, "lead": r.lead}
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

    def segment_tokens(self, inp: ModelInput, opts: SynthesisOptions, segment: int,
                       cancel: CancelToken | None = None) -> Iterator[int]:
        """Speech tokens that reach the flow for one segment (silent-token filter applied); ``cancel``
        goes to the token source."""
        if inp.mode == "vc":
            yield from (int(t) for t in inp.source_speech_tokens.tolist())
            return
        prefill = Prefill(inp.llm_text_ids, tuple(int(t) for t in inp.llm_prompt_speech_tokens.tolist()))
        dec = DecodeOptions(greedy=opts.greedy, seed=offset_seed(opts.seed, segment), max_len=opts.max_tokens,
                            ignore_stop=opts.ignore_stop)
        flt = SilentTokenFilter()
        for tok in self.token_source.generate(prefill, len(inp.text_ids), dec, cancel=cancel):
            if flt.keep(tok):
                yield tok

    def _take(self, inp: ModelInput, opts: SynthesisOptions, segment: int, attempt: int,
              cancel: CancelToken | None = None) -> Take:
        """Attempt ``attempt`` (0: the first) at a text segment's speech tokens, seeded by :func:`retry_seed`
        and watched for a loop or a runaway (docs/retries.md): with ``opts.retries`` 0 a caught take is only
        noted; greedy decoding is never retried (the same take would come back); the benchmarks' forced-length
        decoding (``ignore_stop``) is not judged."""
        prefill = Prefill(inp.llm_text_ids, tuple(int(t) for t in inp.llm_prompt_speech_tokens.tolist()))
        dec = DecodeOptions(greedy=opts.greedy, seed=retry_seed(opts.seed, segment, attempt), max_len=opts.max_tokens,
                            ignore_stop=opts.ignore_stop)
        tokens = self.token_source.generate(prefill, len(inp.text_ids), dec, cancel=cancel)
        max_len = int(MAX_LEN_RATIO * len(inp.text_ids)) if opts.max_tokens is None else None
        return Take(tokens, max_len=max_len, act=opts.retries > 0, detect=not opts.ignore_stop,
                    retry=attempt < opts.retries and not opts.greedy)

    @staticmethod
    def _caught(take: Take, segment: int, attempt: int, opts: SynthesisOptions, action: str | None = None) -> BadTake:
        """The report of a caught take (``action``: what was done; None: cut or kept, as the take says)."""
        if action is None:
            action = "cut" if take.cut is not None else "kept"
        loop = take.loop if take.reason == "loop" else None
        return BadTake(segment, attempt, retry_seed(opts.seed, segment, attempt), take.reason,
                       loop.end if loop is not None else take.n, action,
                       loop.period if loop is not None else None, loop.start if loop is not None else None)

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

    def _run(self, inputs: list[ModelInput], opts: SynthesisOptions, frontend_s: float, *,
             cancel: CancelToken | None = None) -> Synthesis:
        self._check_tokens(inputs, opts)
        timings = Timings(frontend=frontend_s)
        segments: list[Segment] = []
        words = WordTimer(segments, timings, opts.word_language) if opts.word_times else None
        chunks = self._generate(inputs, opts, timings, cancel)
        if opts.loudness is not None:
            from . import loudness

            loudness.require()  # the install hint before any model work
            prompt = self._flow_prompt(inputs[0]) if inputs else None
            chunks = even_loudness(chunks, opts, timings, prompt, self.token2wav, lambda: self._flow_work(False))
        return Synthesis(self._placed(chunks, inputs, segments, words), timings, segments, words)

    def _placed(self, chunks: Iterator[AudioChunk], inputs: list[ModelInput], segments: list[Segment],
                words: WordTimer | None = None) -> Iterator[AudioChunk]:
        """``chunks`` with each one's place in the output (``start``), and a :class:`Segment` appended to
        ``segments`` as each segment's final chunk passes: its samples are those between its first chunk's
        start and the end of its final chunk. ``words``: each segment's audio is handed to it, and aligned
        once the final chunk has been yielded."""
        offset, seg_start, parts = 0, None, []
        try:
            for chunk in chunks:
                if seg_start is None:
                    seg_start = offset
                chunk = replace(chunk, start=offset)
                offset += chunk.samples.size
                if words is not None:
                    parts.append(chunk.samples)
                if chunk.is_final:
                    shown = spoken_text(_shown(inputs[chunk.segment]))
                    segments.append(Segment(chunk.segment, shown, seg_start, offset, chunk.sample_rate))
                    if words is not None:
                        words.add(len(segments) - 1, np.concatenate(parts) if parts else np.zeros(0, np.float32))
                        parts = []
                    seg_start = None
                yield chunk
                if words is not None:
                    words.finish()
        finally:
            chunks.close()  # Synthesis.close(): the LLM sequence goes now, not when the generator is collected

    @contextmanager
    def _flow_work(self, first: bool = False) -> Iterator[None]:
        """Held around each flow + vocoder call of this pipeline: one of its flow slots (when it has a
        limit), then the token source's pause (``first``: the call that makes the request's first audio);
        afterwards the thread's OpenMP workers are given back (:func:`~cosyllama.openmp.release_thread_team`)."""
        try:
            with self._flow_sem if self._flow_sem is not None else nullcontext():
                with self.token_source.pause_for_flow(first):
                    yield
        finally:  # idle, this thread's OpenMP team would slow the next thread's flow call (cosyllama.openmp)
            release_thread_team()

    def _later_flow_work(self, first: bool = False) -> AbstractContextManager[None]:
        """:meth:`_flow_work` for the segments after the first: none of their chunks is the request's first audio."""
        return self._flow_work(False)

    def _generate(self, inputs: list[ModelInput], opts: SynthesisOptions, timings: Timings,
                  cancel: CancelToken | None = None) -> Iterator[AudioChunk]:
        start = time.perf_counter()
        llm_acc = [0.0]
        pause: FlowPause = self._flow_work
        for i, inp in enumerate(inputs):
            if i == 1:  # only the first segment's first chunk is the request's first audio
                pause = self._later_flow_work
            prompt = self._flow_prompt(inp)
            attempt = 0
            while True:  # takes of segment i: a caught take is made again while retries are left (docs/retries.md)
                take = None if inp.mode == "vc" else self._take(inp, opts, i, attempt, cancel)
                tokens = timed(iter(take) if take is not None else self.segment_tokens(inp, opts, i), llm_acc)
                try:
                    if opts.stream:
                        cut = take.cut_at if take is not None else None
                        for chunk in self.token2wav.stream(tokens, prompt, i, pause=pause, cut=cut,
                                                           first_chunk=opts.first_chunk_tokens):
                            timings.audio_seconds += chunk.samples.size / self.sample_rate
                            if chunk.samples.size:
                                if take is not None:
                                    take.audio_out = True  # from now on a caught take is cut, not made again
                                if timings.first_chunk is None:
                                    timings.first_chunk = time.perf_counter() - start + timings.frontend
                            if chunk.is_final:
                                timings.tokens.append(list(chunk.tokens))
                                if take is not None and take.caught:
                                    timings.retries.append(self._caught(take, i, attempt, opts))
                            yield chunk
                    else:
                        toks = list(tokens)
                        if take is not None and take.cut is not None:
                            toks = toks[:take.cut]
                        with pause(False):
                            samples = self.token2wav.full(toks, prompt, opts.speed)
                        timings.tokens.append(toks)
                        timings.audio_seconds += samples.size / self.sample_rate
                        if timings.first_chunk is None:
                            timings.first_chunk = time.perf_counter() - start + timings.frontend
                        if take is not None and take.caught:
                            timings.retries.append(self._caught(take, i, attempt, opts))
                        yield AudioChunk(samples, self.sample_rate, i, True, tuple(toks))
                except RetryTake:
                    timings.retries.append(self._caught(take, i, attempt, opts, "retried"))
                    attempt += 1
                    continue
                break
        timings.llm = llm_acc[0]
        timings.token2wav = time.perf_counter() - start - timings.llm


def load(model_dir: str | Path | LoadOptions, **options) -> TTS:
    """Load a CosyVoice3 model directory: ``load(options)`` with a :class:`~cosyllama.options.LoadOptions`,
    or ``load(model_dir, **fields)`` with its fields as keywords; see :class:`TTS`."""
    return TTS.load(model_dir, **options)


