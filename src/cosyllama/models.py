"""The loaded models of one model directory, apart from any pipeline that uses them.

:class:`Models` is what loading costs (seconds to minutes, gigabytes): the config, the frontend's
encoders, the LLM backend and the flow + vocoder, built once from a
:class:`~cosyllama.options.LoadOptions` and then only read. A :class:`~cosyllama.tts.TTS` is the cheap
per-use pipeline over them (its token source, limits, voices, text worker, flow-slot limit): the
Python API, each server and the batch engine build their own with
:meth:`TTS.from_models <cosyllama.tts.TTS.from_models>`, sharing one :class:`Models`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig, load_config
from .device import resolve_device
from .engine import Token2Wav
from .flow import Flow
from .frontend import Frontend
from .llm.backend import LLMBackend
from .llm.factory import choose_llm, make_llm
from .openmp import gives_team_back
from .options import LoadOptions
from .vocoder import HiFT


@dataclass(frozen=True)
class Models:
    """The read-only models of one model directory (safe to share between threads and pipelines).

    Build with :meth:`load`; ``dataclasses.replace(models, llm=other)`` gives the same models over
    another LLM backend (tests, tools)."""

    options: LoadOptions  # what they were loaded with (model_dir, llm, precision, threads, ... limits)
    config: ModelConfig  # the model directory's cosyvoice3.yaml, read once; every stage is built from it
    device: torch.device  # where the flow, the vocoder and the torch LLM compute
    sample_rate: int  # Hz of the audio made (24000)
    # text tokenizer and normalizer; the ONNX speech tokenizer (16 kHz audio -> 25 Hz int32 ids in [0, 6561))
    # and speaker encoder (-> float32 (192,)); the 80-bin log-mel of prompts
    frontend: Frontend
    llm: LLMBackend  # text + prompt -> float32 (6761,) log-probs of the next speech token, per sequence
    # flow (speech tokens -> float32 (1, 80, 2 frames per token) mel) + vocoder (mel -> float32 24 kHz samples),
    # with the prompt frames streaming requests share
    token2wav: Token2Wav

    @property
    def model_dir(self) -> Path:
        return self.config.model_dir

    @classmethod
    @gives_team_back  # loaded here, maybe served from other threads (cosyllama.openmp)
    def load(cls, options: LoadOptions, *, llm_backend: LLMBackend | None = None) -> Models:
        """Load every model ``options`` asks for. ``llm_backend``: one already built (tests, tools),
        used instead of building one from the options. Sets PyTorch's threads to ``options.threads``
        when given."""
        if llm_backend is None:
            choose_llm(options.llm, options.gguf)  # refuse llama.cpp without a GGUF before loading anything
        device = resolve_device(options.device)
        if options.threads is not None:
            torch.set_num_threads(options.threads)
        config = load_config(options.model_dir)
        frontend = Frontend(config)
        llm = llm_backend if llm_backend is not None else make_llm(
            config, options.llm, gguf=options.gguf, llm_weights=options.llm_weights, device=device,
            threads=options.threads, n_gpu_layers=options.n_gpu_layers, n_seq_max=options.parallel,
            llm_precision=options.llm_precision, max_seq_tokens=options.max_seq_tokens)
        token2wav = Token2Wav.from_config(
            config, Flow.from_config(config, device, precision=options.precision),
            HiFT.from_config(config, device, precision=options.precision),
            stream_cache_mb=options.stream_cache_mb, prompt_cache_mb=options.prompt_cache_mb)
        return cls(options, config, device, config.sample_rate, frontend, llm, token2wav)


__all__ = ["Models"]
