"""What every benchmark sets up: what ``cosyllama bench``, the scripts under ``scripts/`` and the GPU check share.

The full-size random-weight model (real Fun-CosyVoice3-0.5B shapes, so real speed; the audio is
noise) and its GGUFs, made once in the cache directory (:mod:`cosyllama.cachedir`); the prompt
clip; the text; the machine line every result carries. How things are timed (CUDA-synchronized
wall and CPU time, interleaved rounds, best of N) comes from :mod:`cosyllama.timing`.

Light on purpose: torch, numpy and the model code are imported inside the functions that need
them, so a script can import this module before it sets its threading environment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ..cachedir import cache_dir

TOKEN_RATE = 25  # speech tokens per second of audio; the flow makes 2 mel frames per token
BENCH_TEXT = ("The quick brown fox jumps over the lazy dog while the evening sun sets slowly "
              "behind the quiet hills of the old town.")

Progress = Callable[[str], None]


@contextlib.contextmanager
def _made_once(target: Path) -> Iterator[None]:
    """Hold an exclusive lock beside ``target`` while it is made, so two processes (a bench beside a
    demo, two scripts) never write one cached file at once: the second waits, then finds it made.
    Without it, one process's quantizer read the F32 file the other was rewriting and died of SIGBUS."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, and by the OS if we die
        yield


def full_model_dir(seed: int = 0) -> Path:
    """Where the full-size random model of ``seed`` is kept (made or not: see :func:`ensure_full_model`)."""
    return cache_dir() / f"full-random-seed{seed}"


def ensure_full_model(progress: Progress, seed: int = 0) -> Path:
    """The cached full-size random model directory (made on first use, ~4 GB)."""
    from .synthetic import make_model

    d = full_model_dir(seed)
    if (d / ".complete").exists():
        return d
    with _made_once(d):
        if not (d / ".complete").exists():  # another process may have made it while we waited
            progress(f"making the full-size random-weight model in {d} (once)")
            make_model(d, size="full", seed=seed, force=True, progress=progress)
            (d / ".complete").write_text("ok\n")
    return d


def gguf_path(model_dir: Path, layout: str, type_name: str) -> Path:
    """Where the GGUF of ``model_dir``'s LLM in ``layout`` and ``type_name`` is kept (made or not)."""
    import hashlib

    model_dir = Path(model_dir).resolve()
    key = f"{model_dir.name}-{hashlib.sha1(str(model_dir).encode()).hexdigest()[:10]}"
    return cache_dir() / "gguf" / key / f"llm-{layout}-{type_name}.gguf"


def ensure_gguf(model_dir: Path, layout: str, type_name: str, progress: Progress) -> Path:
    """The cached GGUF of ``model_dir``'s LLM (converted on first use)."""
    out = gguf_path(model_dir, layout, type_name)
    if out.exists():
        return out
    with _made_once(out):
        if not out.exists():  # another process may have converted it while we waited
            from ..llm.gguf import convert
            from ..progress import counting_progress

            progress(f"converting the LLM to {out.name} (once)")
            convert(model_dir, out, layout=layout, type=type_name, progress=counting_progress(progress))
    return out


def prompt_wav(seconds: float) -> Path:
    """A deterministic voiced-like test clip (16 kHz) standing in for a real prompt."""
    import numpy as np
    import soundfile as sf

    path = cache_dir() / f"bench-prompt-{seconds:g}s.wav"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        t = np.arange(int(16000 * seconds)) / 16000
        f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
        wav = 0.3 * np.sin(2 * np.pi * np.cumsum(f0) / 16000) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
        wav += 0.01 * rng.standard_normal(t.size)
        sf.write(path, wav.astype(np.float32), 16000)
    return path


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def machine_info(threads: int, device="cpu", llm: bool = True) -> dict:
    """The machine and the CPU path (class, ISA, torch kernels, llama.cpp build) the rows ran on."""
    import torch

    from ..cpu import CpuPath

    info = CpuPath(threads=threads, device=str(device), llm="llamacpp" if llm else "torch").as_dict()
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["torch"] = torch.__version__
    return info
