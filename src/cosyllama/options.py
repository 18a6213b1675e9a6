"""How a TTS is built: :class:`LoadOptions`, frozen and checked once, here.

Every place that builds a :class:`~cosyllama.tts.TTS` goes through it: ``cosyllama.load`` and
``TTS(...)`` (the Python API), the commands (:meth:`LoadOptions.from_args` turns parsed arguments into
options once), the servers, batch, bench, demo and the upstream facade. The stages get their pieces from
it and the model directory's config, which the TTS reads once and hands down.

Light on purpose (no torch): a command checks its options before minutes of loading.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from .config import absolute_path
from .defaults import LLM_CHOICES, LLM_PRECISION, LLM_PRECISIONS, LLM_WEIGHTS, N_SEQ_MAX, PRECISION
from .errors import InputError
from .limits import RequestLimits


class OptionError(InputError):
    """A bad option; ``field`` names it, so a command can say it in its own words (``--flag``)."""

    def __init__(self, field: str, template: str):
        super().__init__(template.format(name=field))
        self.field, self.template = field, template

    def as_flag(self) -> InputError:
        return InputError(self.template.format(name="--" + self.field.replace("_", "-")))


@dataclass(frozen=True)
class LoadOptions:
    """Everything that decides how a TTS is built.

    model_dir: the official model directory. gguf: the LLM as a GGUF file. Both may be relative (to the
    current directory) or absolute; the options hold them absolute. llm: ``"torch"`` (PyTorch) or
    ``"llamacpp"`` (needs ``gguf``); None: llama.cpp when ``gguf`` is given, else torch. llm_weights: the
    LLM checkpoint, a file of the model directory (``"llm.pt"``, or the RL-tuned ``"llm.rl.pt"``) or an
    absolute path; a GGUF must have been converted from the same file. device: ``"cpu"`` or ``"cuda"``
    for the flow and vocoder (and the torch LLM, whose decode steps run as CUDA graphs there).
    n_gpu_layers: llama.cpp layers on the GPU (None: all of them with ``device="cuda"``, else none).
    llm_precision: the torch LLM's weights, ``"fp32"`` (parity) or ``"bf16"``/``"fp16"`` (for a GPU).
    precision: flow compute, ``"auto"``, ``"fp32"``, ``"bf16"`` or ``"int8"`` (see
    :mod:`cosyllama.precision`); the vocoder stays fp32 unless ``"bf16"`` is asked for. threads: torch
    CPU threads (process-wide) and llama.cpp threads (None: all cores). parallel: sequences one LLM
    context decodes together. max_seq_tokens: LLM positions one text segment may use; given, the
    llama.cpp context is made at load for ``parallel`` such sequences and never grows (None: the model's
    context length). limits: :class:`~cosyllama.limits.RequestLimits` every call is checked against
    (None: only the LLM's). stream_cache_mb / prompt_cache_mb: bounds in MiB of the streaming caches
    (None: their defaults; 0: off; see :class:`~cosyllama.engine.Token2Wav`).
    """

    model_dir: str | Path
    llm: str | None = "torch"
    gguf: str | Path | None = None
    llm_weights: str | Path = LLM_WEIGHTS
    device: str = "cpu"
    n_gpu_layers: int | None = None
    llm_precision: str = LLM_PRECISION
    precision: str = PRECISION
    threads: int | None = None
    parallel: int = N_SEQ_MAX
    max_seq_tokens: int | None = None
    limits: RequestLimits | None = None
    stream_cache_mb: float | None = None
    prompt_cache_mb: float | None = None

    def __post_init__(self):
        # Paths are made absolute once, here: relative ones are taken from the current directory, and
        # nothing built from these options (a llama.cpp backend, a Ray actor) depends on where it runs.
        object.__setattr__(self, "model_dir", absolute_path(self.model_dir))
        if self.gguf not in (None, ""):
            object.__setattr__(self, "gguf", absolute_path(self.gguf))
        if self.llm is None:
            object.__setattr__(self, "llm", "llamacpp" if self.gguf else "torch")
        if self.llm not in LLM_CHOICES:
            raise InputError(f"llm must be one of {', '.join(LLM_CHOICES)}, got {self.llm!r}")
        if self.llm == "torch" and self.gguf is not None:
            raise InputError("a GGUF file was given but llm='torch'; pass llm='llamacpp' to use it")
        if self.llm_precision not in LLM_PRECISIONS:
            raise InputError(f"LLM precision must be one of {', '.join(LLM_PRECISIONS)}, got {self.llm_precision!r}")
        for name in ("threads", "parallel"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise OptionError(name, "{name} must be >= 1, got " + str(v))
        for name in ("stream_cache_mb", "prompt_cache_mb"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise OptionError(name, "{name} must be >= 0, got " + repr(v))

    def replace(self, **changes) -> LoadOptions:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    @classmethod
    def of(cls, model_dir: str | Path | LoadOptions, **changes) -> LoadOptions:
        """``model_dir`` as options: options as given (with ``changes``), or a directory with ``changes``."""
        if isinstance(model_dir, LoadOptions):
            return model_dir.replace(**changes) if changes else model_dir
        return cls(model_dir, **changes)

    @classmethod
    def from_args(cls, args, defaults: dict | None = None, **changes) -> LoadOptions:
        """The options of a command's parsed arguments, the one place a command's flags become options:
        every field the command has a flag of (unset flags keep the defaults), the backend from ``--llm``
        and ``--gguf`` (llama.cpp when a GGUF is given), the per-request limits where the command has
        them (``serve``, ``wyoming``: their ``--max-seq-tokens`` sizes the LLM context), then
        ``changes``; ``defaults``: values of the fields the command has no flag of. Errors name the flags."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if f.name not in ("llm", "limits", "max_seq_tokens") and getattr(args, f.name, None) is not None}
        llm, gguf = getattr(args, "llm", None), given.get("gguf")
        if llm == "llamacpp" and gguf is None:
            raise InputError("--llm llamacpp needs --gguf FILE (make one with `cosyllama convert`)")
        if llm == "torch" and gguf is not None:
            raise InputError("--gguf is for --llm llamacpp; drop --gguf or pass --llm llamacpp")
        given["llm"] = llm  # None: llama.cpp when a GGUF is given
        if hasattr(args, "max_seq_tokens"):  # the server's per-request limits
            limits = RequestLimits.from_args(args)
            given["max_seq_tokens"] = limits.seq_tokens
        try:
            return cls(**{**(defaults or {}), **given, **changes})
        except OptionError as e:
            raise e.as_flag() from None


__all__ = ["LoadOptions", "OptionError"]
