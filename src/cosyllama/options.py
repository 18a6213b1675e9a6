"""How a TTS is built: :class:`LoadOptions`, frozen and checked once, here.

Every place that builds a :class:`~cosyllama.tts.TTS` goes through it: ``cosyllama.load`` and
``TTS(...)`` (the Python API), the commands (:func:`cosyllama.commands.options.load_options` turns parsed
arguments into options once), the servers, batch, bench, demo and the upstream facade. Each choice is
checked against its one vocabulary in :mod:`cosyllama.defaults`. The stages get their pieces from
it and the model directory's config, which the TTS reads once and hands down.

Light on purpose (no torch): a command checks its options before minutes of loading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from .config import absolute_path
from .defaults import (
    DEVICES,
    LLM_CHOICES,
    LLM_PRECISION,
    LLM_PRECISIONS,
    LLM_WEIGHTS,
    N_SEQ_MAX,
    PRECISION,
    PRECISION_ALIASES,
    PRECISIONS,
)
from .errors import InputError
from .limits import RequestLimits


class OptionError(InputError):
    """A bad option; ``field`` names it, so a command can say it in its own words (``--flag``).
    ``flag``: the message in the command line's words, where it is not the template with the flag's name."""

    def __init__(self, field: str, template: str, flag: str | None = None):
        super().__init__(template.format(name=field))
        self.field, self.template, self.flag = field, template, flag

    def as_flag(self) -> InputError:
        if self.flag is not None:
            return InputError(self.flag)
        return InputError(self.template.format(name="--" + self.field.replace("_", "-")))


_DEVICE = re.compile(r"(cpu|cuda)(:[0-9]+)?")


def precision_key(value) -> str | None:
    """The flow precision ``value`` names, one of :data:`~cosyllama.defaults.PRECISIONS` (also their
    other spellings, e.g. ``"bfloat16"``, and the torch dtypes float32 / bfloat16 / qint8); None: not one."""
    if isinstance(value, str):
        key = value.strip().lower()
        key = PRECISION_ALIASES.get(key, key)
        return key if key in PRECISIONS else None
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.qint8": "int8"}.get(str(value))


@dataclass(frozen=True)
class LoadOptions:
    """Everything that decides how a TTS is built; every field is checked here, on construction
    (a changed copy is checked again), before anything loads."""

    # the official model directory; relative to the current directory or absolute, held absolute
    model_dir: str | Path
    # the LLM backend, one of defaults.LLM_CHOICES: "torch" (PyTorch) or "llamacpp" (needs gguf);
    # None: llama.cpp when gguf is given, else torch
    llm: str | None = "torch"
    # the LLM as a GGUF file for llama.cpp (`cosyllama convert`); held absolute
    gguf: str | Path | None = None
    # the LLM checkpoint: a file of the model directory ("llm.pt", or the RL-tuned "llm.rl.pt") or an
    # absolute path; a GGUF must have been converted from the same file
    llm_weights: str | Path = LLM_WEIGHTS
    # where the flow and vocoder run (and the torch LLM, as CUDA graphs there): "cpu", "cuda" or "cuda:N"
    device: str = "cpu"
    # llama.cpp layers on the GPU; None: all of them with device cuda, else none
    n_gpu_layers: int | None = None
    # the torch LLM's weights and KV cache, one of defaults.LLM_PRECISIONS: "fp32" (parity) or
    # "bf16"/"fp16" (for a GPU); a llama.cpp LLM computes in its GGUF's type and takes only "fp32"
    llm_precision: str = LLM_PRECISION
    # flow compute, one of defaults.PRECISIONS: "auto", "fp32", "bf16" or "int8" (CPU only; see
    # cosyllama.precision); the vocoder stays fp32 unless "bf16" is asked for
    precision: str = PRECISION
    # torch CPU threads (process-wide) and llama.cpp threads; None: all cores
    threads: int | None = None
    # LLM sequences one context decodes together
    parallel: int = N_SEQ_MAX
    # LLM positions one text segment may use; given, the llama.cpp context is made at load for `parallel`
    # such sequences and never grows; None: the model's context length
    max_seq_tokens: int | None = None
    # the cosyllama.limits.RequestLimits every call is checked against; None: only the LLM's
    limits: RequestLimits | None = None
    # bound in MiB of each streaming request's flow K/V cache; None: its default; 0: off
    # (see cosyllama.engine.Token2Wav)
    stream_cache_mb: float | None = None
    # bound in MiB of the flow blocks shared between requests of one voice; None: its default; 0: off
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
            raise OptionError("llm", f"{{name}} must be one of {', '.join(LLM_CHOICES)}, got {self.llm!r}")
        if self.llm == "torch" and self.gguf is not None:
            raise OptionError("gguf", "a GGUF file was given but llm='torch'; pass llm='llamacpp' to use it",
                              flag="--gguf is for --llm llamacpp; drop --gguf or pass --llm llamacpp")
        if self.llm_precision not in LLM_PRECISIONS:
            raise OptionError("llm_precision", f"LLM precision must be one of {', '.join(LLM_PRECISIONS)}, got "
                              f"{self.llm_precision!r}",
                              flag=f"--llm-precision must be one of {', '.join(LLM_PRECISIONS)}, got "
                                   f"{self.llm_precision!r}")
        if self.llm == "llamacpp" and self.llm_precision != LLM_PRECISION:
            raise OptionError("llm_precision", "the LLM precision applies to the torch LLM; a llama.cpp LLM "
                              "computes in its GGUF's type (choose it with `cosyllama convert --type`)")
        device = "cpu" if self.device is None else str(self.device)  # None: the CPU, as it always meant
        if not _DEVICE.fullmatch(device):
            raise OptionError("device", f"device must be one of {', '.join(DEVICES)} or cuda:N, got {device!r}",
                              flag=f"--device must be one of {', '.join(DEVICES)} or cuda:N, got {device!r}")
        precision = precision_key(self.precision)
        if precision is None:
            raise OptionError("precision", f"{{name}} {self.precision!r} is not supported; use one of "
                              f"{', '.join(PRECISIONS)}")
        if precision == "int8" and not device.startswith("cpu"):
            raise OptionError("precision", f"precision int8 runs on the CPU only (PyTorch's x86 int8 kernels); "
                              f"on {device} use bf16, fp32 or auto")
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


__all__ = ["LoadOptions", "OptionError", "precision_key"]
