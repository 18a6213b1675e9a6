"""``cosyllama synth``: one synthesis from the command line, with per-stage timings and the RTF."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import InputError

SUBTYPES = {"pcm16": "PCM_16", "float": "FLOAT"}


def check_out_path(path: str | Path) -> Path:
    """Refuse an output path that cannot be written, before any synthesis work."""
    path = Path(path)
    if path.suffix.lower() != ".wav":
        raise InputError(f"--out must be a .wav file, got {str(path)!r}")
    if not path.parent.is_dir():
        raise InputError(f"cannot write {str(path)!r}: directory {str(path.parent)!r} does not exist")
    return path


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int, out_format: str = "pcm16") -> None:
    """Write mono audio; 16-bit PCM (default) or 32-bit float."""
    import soundfile as sf

    path = check_out_path(path)
    try:
        sf.write(path, np.asarray(samples, dtype=np.float32), sample_rate, subtype=SUBTYPES[out_format])
    except (OSError, RuntimeError) as e:
        raise InputError(f"cannot write {str(path)!r}: {e}") from e


def run_synth(args, progress: Callable[[str], None] = print) -> int:
    from .options import LoadOptions
    from .tts import TTS, SynthesisOptions, choose_mode

    if not args.text or not args.text.strip():
        raise InputError("--text is empty; give the text to speak")
    mode = choose_mode(args.mode, args.instruct, bool(args.prompt_text))
    options = LoadOptions.from_args(args)
    llm = options.llm
    if args.prompt_wav is None:
        raise InputError(f"{mode} mode needs --prompt-wav (a 16 kHz+ clip of the voice, up to 30 s)")
    if mode == "zero-shot" and not args.prompt_text:
        raise InputError("zero-shot mode needs --prompt-text (the transcript of --prompt-wav); "
                         "use --mode cross-lingual without one")
    if mode == "instruct" and not args.instruct:
        raise InputError("instruct mode needs --instruct TEXT")
    if not Path(args.prompt_wav).is_file():
        raise InputError(f"prompt audio {args.prompt_wav!r} does not exist")
    if args.gguf and not Path(args.gguf).is_file():
        raise InputError(f"GGUF file {args.gguf!r} does not exist")
    check_out_path(args.out)

    t0 = time.perf_counter()
    tts = TTS(options)
    load_s = time.perf_counter() - t0
    progress(f"loaded {args.model_dir} (llm: {llm}{', ' + Path(args.gguf).name if args.gguf else ''}, "
             f"device: {tts.device}) in {load_s:.1f} s")
    from .cpu import tts_path

    for line in tts_path(tts, args.precision, args.threads).lines():
        progress(line)

    opts = SynthesisOptions(stream=args.stream, speed=args.speed, greedy=args.greedy, seed=args.seed)
    syn = tts.synthesize(args.text, mode=mode, instruction=args.instruct, prompt_wav=args.prompt_wav,
                         prompt_text=args.prompt_text if mode == "zero-shot" else None, options=opts)

    t1 = time.perf_counter()
    parts = []
    for chunk in syn:
        parts.append(chunk.samples)
        if args.stream and chunk.samples.size:
            progress(f"  chunk {len(parts)} (segment {chunk.segment}): {chunk.samples.size / tts.sample_rate:.2f} s "
                     f"of audio at {time.perf_counter() - t1:.2f} s")
    wall = time.perf_counter() - t1 + syn.timings.frontend
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    write_wav(args.out, audio, tts.sample_rate, args.out_format)
    if args.tokens_out:
        Path(args.tokens_out).write_text(json.dumps(syn.timings.tokens), encoding="utf-8")

    t = syn.timings
    secs = audio.size / tts.sample_rate
    rtf = wall / secs if secs else float("nan")
    n_tok = sum(len(x) for x in t.tokens)
    progress(f"frontend {t.frontend:.2f} s | llm {t.llm:.2f} s ({n_tok} tokens, "
             f"{n_tok / t.llm if t.llm else 0:.1f} tok/s) | flow+vocoder {t.token2wav:.2f} s")
    first = f" | first audio after {t.first_chunk:.2f} s" if args.stream and t.first_chunk is not None else ""
    progress(f"{secs:.2f} s of audio in {wall:.2f} s: RTF {rtf:.3f}{first}")
    print(f"wrote {args.out}")
    return 0
