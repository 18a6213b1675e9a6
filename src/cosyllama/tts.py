"""The native Python API: :func:`load` returns a :class:`TTS` with one method per mode, each a
generator of :class:`~cosyllama.engine.AudioChunk`.

>>> tts = cosyllama.load("Fun-CosyVoice3-0.5B", llm="llamacpp", gguf="cv3-speech-q8_0.gguf")
>>> voice = tts.make_voice("prompt.wav", "Transcript of the prompt.")
>>> audio = np.concatenate([c.samples for c in tts.zero_shot("Hello there!", voice=voice)])

A :class:`TTS` holds only read-only models; every call keeps its state in its own generator, so
calls may run from several threads or be interleaved.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .audio import AudioSource
from .config import load_config
from .device import resolve_device
from .engine import AudioChunk, FlowPrompt, Token2Wav, check_speed
from .errors import InputError
from .flow import Flow
from .frontend import Frontend, ModelInput, PromptFeatures
from .llm.backend import LLMBackend, Prefill
from .llm.decode import DecodeOptions, SilentTokenFilter, generate
from .vocoder import HiFT
from .voices import VoiceStore

LLM_CHOICES = ("torch", "llamacpp")


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-call options.

    stream: yield audio chunk by chunk as tokens are decoded. speed: 0.5-2.0 time stretch of the
    finished mel (non-streaming only). greedy: argmax decoding. seed: makes sampling reproducible
    (segment i uses seed + i). text_frontend: normalize and split the text. russian_numbers: spell
    numbers in Russian sentences in Russian (else English, as the reference does).
    max_tokens / ignore_stop: decoding overrides used by benchmarks.
    """

    stream: bool = False
    speed: float = 1.0
    greedy: bool = False
    seed: int | None = None
    text_frontend: bool = True
    russian_numbers: bool = True
    max_tokens: int | None = None
    ignore_stop: bool = False


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

    def __init__(self, chunks: Iterator[AudioChunk], timings: Timings):
        self._chunks, self.timings = chunks, timings

    def __next__(self) -> AudioChunk:
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


class DirectTokens:
    """Token source that decodes each request on its own (the default).

    A token source has ``generate(prefill, n_text_tokens, options) -> Iterator[int]`` with the
    semantics of :func:`cosyllama.llm.decode.generate` (closing the iterator frees the sequence).
    The server swaps in a batching scheduler that advances many requests in one backend step.
    """

    def __init__(self, backend: LLMBackend):
        self.backend = backend

    def generate(self, prefill: Prefill, n_text_tokens: int, options: DecodeOptions) -> Iterator[int]:
        return generate(self.backend, prefill, n_text_tokens, options)


class TTS:
    """CosyVoice3 synthesis from an official model directory.

    llm: ``"torch"`` (float32 PyTorch) or ``"llamacpp"`` (needs ``gguf``). device: ``"cpu"`` or
    ``"cuda"`` for the flow and vocoder (and the torch LLM); n_gpu_layers: llama.cpp layers to
    offload. threads: torch CPU threads (process-wide) and llama.cpp threads. precision: flow
    compute, ``"auto"`` (bf16 where the CPU/GPU does it natively, else fp32), ``"fp32"`` (the
    reference path) or ``"bf16"``; the vocoder stays fp32 unless ``"bf16"`` is asked for.
    stream_cache_mb: bound in MiB of each streaming request's flow K/V cache (earlier attention
    blocks are not recomputed for later chunks; ~1.7 MB per mel frame in bf16); None: 2048 at bf16,
    off at fp32 (reference parity); 0: off. prompt_cache_mb: bound in MiB of the flow frames that
    streaming requests with the same voice share (their first chunk skips them; ~180 MB per 3 s
    voice in bf16); None: 512 whenever the streaming cache is on, else off; 0: off.
    """

    def __init__(self, model_dir: str | Path, llm: str = "torch", gguf: str | Path | None = None,
                 device: str = "cpu", threads: int | None = None, n_gpu_layers: int = 0,
                 llm_backend: LLMBackend | None = None, precision: str = "auto",
                 stream_cache_mb: float | None = None, prompt_cache_mb: float | None = None):
        if llm not in LLM_CHOICES:
            raise InputError(f"llm must be one of {', '.join(LLM_CHOICES)}, got {llm!r}")
        if llm == "llamacpp" and gguf is None and llm_backend is None:
            raise InputError("llm='llamacpp' needs a GGUF file (gguf=...); make one with "
                             "`cosyllama convert --model-dir DIR --out FILE.gguf`")
        if llm == "torch" and gguf is not None:
            raise InputError("a GGUF file was given but llm='torch'; pass llm='llamacpp' to use it")
        self.device = resolve_device(device)
        if threads is not None:
            if threads < 1:
                raise InputError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        self.config = load_config(model_dir)
        self.model_dir = self.config.model_dir
        self.sample_rate = self.config.sample_rate
        self.frontend = Frontend(self.model_dir, self.config)
        if llm_backend is not None:
            self.llm = llm_backend
        elif llm == "torch":
            from .llm.torch_backend import TorchLLM
            from .weights import load_llm_weights

            self.llm = TorchLLM(self.config.llm, load_llm_weights(self.model_dir / "llm.pt", self.config.llm),
                                self.device)
        else:
            from .llm.llamacpp_backend import LlamaCppLLM

            self.llm = LlamaCppLLM(gguf, self.model_dir, n_threads=threads, n_gpu_layers=n_gpu_layers)
        self.token2wav = Token2Wav(Flow.from_dir(self.model_dir, self.device, precision=precision),
                                   HiFT.from_dir(self.model_dir, self.device, precision=precision), self.sample_rate,
                                   lookahead=self.config.flow.pre_lookahead_len,
                                   token_mel_ratio=self.config.token_mel_ratio,
                                   stream_cache_mb=stream_cache_mb, prompt_cache_mb=prompt_cache_mb)
        self.token_source = DirectTokens(self.llm)
        self.voices = VoiceStore()

    # -- voices ------------------------------------------------------------------------------------

    def make_voice(self, prompt_wav: AudioSource, prompt_text: str | None = None) -> PromptFeatures:
        """Prompt tokens, speaker embedding and prompt mel of a clip (16 kHz+, up to 30 s), once."""
        return self.frontend.make_voice(prompt_wav, prompt_text)

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

    def _voice(self, voice: PromptFeatures | str | None,
               prompt_wav: AudioSource | None) -> PromptFeatures | AudioSource:
        """The registered or given voice, else the prompt clip; the frontend turns a clip into a
        voice (and checks what each mode needs of it)."""
        if voice is not None and prompt_wav is not None:
            raise InputError("give either a voice or a prompt_wav, not both")
        if isinstance(voice, str):
            return self.voices.get(voice)
        if voice is None and prompt_wav is None:
            raise InputError("this mode needs a prompt: give prompt_wav (a 16 kHz+ clip up to 30 s) "
                             "or a registered voice")
        return voice if voice is not None else prompt_wav

    # -- modes ------------------------------------------------------------------------------------

    def zero_shot(self, text: str, prompt_wav: AudioSource | None = None, prompt_text: str | None = None, *,
                  voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                  **kw) -> Synthesis:
        """Clone the prompt's voice saying ``text``; the LLM continues the prompt's transcript."""
        opts = self._options(options, kw)
        t0 = time.perf_counter()
        inputs = self.frontend.zero_shot(text, self._voice(voice, prompt_wav), prompt_text,
                                         text_frontend=opts.text_frontend, russian_numbers=opts.russian_numbers)
        return self._run(inputs, opts, time.perf_counter() - t0)

    def cross_lingual(self, text: str, prompt_wav: AudioSource | None = None, *,
                      voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                      **kw) -> Synthesis:
        """Speak ``text`` (any language) in the prompt's voice, without its transcript."""
        opts = self._options(options, kw)
        t0 = time.perf_counter()
        v = self._voice(voice, prompt_wav)
        inputs = self.frontend.cross_lingual(text, v, text_frontend=opts.text_frontend,
                                             russian_numbers=opts.russian_numbers)
        return self._run(inputs, opts, time.perf_counter() - t0)

    def instruct(self, text: str, instruction: str, prompt_wav: AudioSource | None = None, *,
                 voice: PromptFeatures | str | None = None, options: SynthesisOptions | None = None,
                 **kw) -> Synthesis:
        """Speak ``text`` in the prompt's voice following ``instruction`` (CosyVoice3 instruct2)."""
        opts = self._options(options, kw)
        if not instruction or not instruction.strip():
            raise InputError("instruct mode needs a non-empty instruction")
        t0 = time.perf_counter()
        v = self._voice(voice, prompt_wav)
        inputs = self.frontend.instruct2(text, instruction, v, text_frontend=opts.text_frontend,
                                         russian_numbers=opts.russian_numbers)
        return self._run(inputs, opts, time.perf_counter() - t0)

    def voice_conversion(self, source_wav: AudioSource, prompt_wav: AudioSource, *,
                         options: SynthesisOptions | None = None, **kw) -> Synthesis:
        """Re-render the speech of ``source_wav`` in the voice of ``prompt_wav`` (no LLM)."""
        opts = self._options(options, kw)
        t0 = time.perf_counter()
        inp = self.frontend.vc(source_wav, prompt_wav)
        return self._run([inp], opts, time.perf_counter() - t0)

    # -- the shared path ----------------------------------------------------------------------------

    def _options(self, options: SynthesisOptions | None, kw: dict) -> SynthesisOptions:
        opts = options or SynthesisOptions()
        if kw:
            unknown = set(kw) - set(SynthesisOptions.__dataclass_fields__)
            if unknown:
                raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; allowed: "
                                f"{', '.join(SynthesisOptions.__dataclass_fields__)}")
            opts = replace(opts, **kw)
        check_speed(opts.speed, opts.stream)
        return opts

    def _flow_prompt(self, inp: ModelInput) -> FlowPrompt:
        tokens, feat = inp.flow_prompt_speech_tokens, inp.prompt_feat
        if inp.mode == "vc":
            # The reference leaves the VC prompt unaligned (quirk Q10), which shifts the boundary
            # between prompt and converted speech; we align it like every other mode.
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

    def _run(self, inputs: list[ModelInput], opts: SynthesisOptions, frontend_s: float) -> Synthesis:
        timings = Timings(frontend=frontend_s)
        return Synthesis(self._generate(inputs, opts, timings), timings)

    def _generate(self, inputs: list[ModelInput], opts: SynthesisOptions, timings: Timings) -> Iterator[AudioChunk]:
        start = time.perf_counter()
        llm_acc = [0.0]
        for i, inp in enumerate(inputs):
            prompt = self._flow_prompt(inp)
            tokens = _timed(self.segment_tokens(inp, opts, i), llm_acc)
            if opts.stream:
                for chunk in self.token2wav.stream(tokens, prompt, i):
                    timings.audio_seconds += chunk.samples.size / self.sample_rate
                    if timings.first_chunk is None and chunk.samples.size:
                        timings.first_chunk = time.perf_counter() - start + timings.frontend
                    if chunk.is_final:
                        timings.tokens.append(list(chunk.tokens))
                    yield chunk
            else:
                toks = list(tokens)
                samples = self.token2wav.full(toks, prompt, opts.speed)
                timings.tokens.append(toks)
                timings.audio_seconds += samples.size / self.sample_rate
                if timings.first_chunk is None:
                    timings.first_chunk = time.perf_counter() - start + timings.frontend
                yield AudioChunk(samples, self.sample_rate, i, True, tuple(toks))
        timings.llm = llm_acc[0]
        timings.token2wav = time.perf_counter() - start - timings.llm


def load(model_dir: str | Path, llm: str = "torch", gguf: str | Path | None = None, device: str = "cpu",
         threads: int | None = None, n_gpu_layers: int = 0, precision: str = "auto",
         stream_cache_mb: float | None = None, prompt_cache_mb: float | None = None) -> TTS:
    """Load a CosyVoice3 model directory; see :class:`TTS`."""
    return TTS(model_dir, llm=llm, gguf=gguf, device=device, threads=threads, n_gpu_layers=n_gpu_layers,
               precision=precision, stream_cache_mb=stream_cache_mb, prompt_cache_mb=prompt_cache_mb)
