"""``cosyllama demo``: the whole pipeline on a full-size random-weight model, no downloads.

The model has the real Fun-CosyVoice3-0.5B shapes, so the timings are real; its weights are
random, so the audio is noise. With the official model directory, use ``cosyllama synth``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

DEMO_TEXT = "Hello from cosyllama. This is the no-weights demo of the full CosyVoice3 pipeline."


def run_demo(*, threads: int | None = None, seconds: float = 10.0, out_dir: str | Path | None = None,
             progress: Callable[[str], None] = print) -> int:
    """Both backends on the full-size random model: ``threads`` CPU threads (None: all cores), at most
    ``seconds`` of audio each, the WAVs written to ``out_dir`` (None: the cache directory)."""
    from ..audio_out import write_wav
    from ..cachedir import cache_dir
    from ..cpu import tts_path
    from ..options import LoadOptions
    from ..tts import TTS, SynthesisOptions
    from .bench_setup import ensure_full_model, ensure_gguf, prompt_wav

    model_dir = ensure_full_model(progress)
    gguf = ensure_gguf(model_dir, "speech", "Q8_0", progress)
    wav = prompt_wav(3.0)
    out_dir = Path(out_dir) if out_dir else cache_dir() / "demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = SynthesisOptions(seed=0, max_tokens=round(seconds * 25))
    rows = []
    for llm in ("torch", "llamacpp"):
        t0 = time.perf_counter()
        tts = TTS(LoadOptions(model_dir, llm=llm, gguf=gguf if llm == "llamacpp" else None, threads=threads))
        load_s = time.perf_counter() - t0
        progress(f"{llm}: loaded in {load_s:.1f} s; synthesizing (3 s prompt, up to {seconds:g} s of audio)")
        path = tts_path(tts, "auto", threads)
        for line in path.lines():
            progress("  " + line)
        t0 = time.perf_counter()
        syn = tts.cross_lingual(DEMO_TEXT, wav, options=opts)
        audio = syn.audio()
        wall = time.perf_counter() - t0
        out = out_dir / f"demo-{llm}.wav"
        write_wav(out, audio, tts.sample_rate)
        t = syn.timings
        secs = audio.size / tts.sample_rate
        n_tok = sum(len(x) for x in t.tokens)
        rows.append((llm, t.frontend, t.llm, n_tok, t.token2wav, secs, wall))
        segments = len(t.tokens)
        progress(f"  wrote {out}")
        del tts
    print(f"\n{'LLM backend':<12}{'frontend s':>11}{'LLM s':>8}{'tok/s':>8}{'flow+voc s':>11}{'audio s':>9}{'RTF':>7}")
    for llm, fe, llm_s, n, tw, secs, wall in rows:
        print(f"{llm:<12}{fe:>11.2f}{llm_s:>8.2f}{n / llm_s if llm_s else 0:>8.1f}{tw:>11.2f}{secs:>9.2f}"
              f"{wall / secs:>7.2f}")
    print("\n" + rtf_meaning(path, segments))
    print("\nThe model has the real Fun-CosyVoice3-0.5B shapes but random weights: the timings are real, the "
          "audio is noise.\nWith the official model directory: cosyllama synth --model-dir Fun-CosyVoice3-0.5B ...")
    return 0


def rtf_meaning(path, segments: int) -> str:
    """What the demo's RTF means on this CPU class, and where to compare it."""
    d = path.as_dict()
    why = d.get("flow_precision_why", "")
    lines = [f"RTF = wall seconds / audio seconds (below 1 is faster than real time). This CPU is of the "
             f"{d['cpu_class']} class; the flow ran at {d.get('flow_precision', '?')} ({why}) on {path.threads} "
             f"threads."]
    if d.get("flow_precision") in ("fp32", "int8") and not d["native_bf16"]:
        lines.append(f"Without native bf16 the flow runs {'int8' if d['flow_precision'] == 'int8' else 'float32'}, "
                     "slower than bf16 on an AVX512-BF16/AMX CPU: a higher RTF here is expected, not a broken "
                     "install.")
    if segments > 1:
        lines.append(f"The text was split into {segments} segments; each one runs the flow over the 3 s prompt "
                     f"again, which adds to the RTF of a short text.")
    lines.append(f"Compare with the '{d['cpu_class']}' column of docs/benchmarks.md (section \"Per CPU class\"), "
                 f"measured with `cosyllama demo` and `cosyllama bench` on such a CPU.")
    return "\n".join(lines)
