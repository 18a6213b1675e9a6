"""Time the speech-token LLM: torch fp32 vs llama.cpp GGUFs (speech/merged layouts x types), same run.

Uses a full-size random-weight model directory (real Fun-CosyVoice3-0.5B shapes: hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, text vocab 151936, speech vocab 6761), made
once with ``make_model(size="full")`` in the cache directory; GGUFs are converted once beside it.
Every configuration decodes the same forced length (stop ids masked, RAS sampling with a fixed
seed) after the same prefill, so the work is equal. All configurations are loaded at once and
timed in interleaved rounds; by default each one's fastest round is reported, because other
processes on a shared machine only ever slow a run down (llama.cpp's spinning thread barriers
suffer most when a core is taken). Prints one table; ``--json`` writes the ``cosyllama bench``
``llm`` list.

    python scripts/bench_llm.py                               # 2 threads, speech+merged x F16,Q8_0,Q4_K_M
    python scripts/bench_llm.py --types Q8_0 --layouts speech --no-torch --n-batch 64 --flash-attn on
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from cosyllama.llm.backend import Prefill
from cosyllama.llm.decode import DecodeOptions, TokenDecoder

TOKENS_PER_SECOND = 25  # speech tokens per second of audio
ENDOFPROMPT = 151646


def default_cache() -> Path:
    return Path(os.environ.get("COSYLLAMA_CACHE", Path.home() / ".cache" / "cosyllama")) / "bench-full"


def ensure_model(model_dir: Path) -> Path:
    if not (model_dir / "llm.pt").is_file():
        from cosyllama.synthetic import make_model
        print(f"making a full-size random model in {model_dir} (once) ...", flush=True)
        make_model(model_dir, size="full", seed=0, force=True, progress=lambda m: print("  " + m, flush=True))
    return model_dir


def ensure_gguf(model_dir: Path, gguf_dir: Path, layout: str, type: str) -> Path:
    from cosyllama.llm.gguf import convert
    out = gguf_dir / f"{layout}-{type}.gguf"
    if not out.is_file():
        gguf_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        last = [0.0]

        def progress(stage, done, total):
            if done == total or time.perf_counter() - last[0] > 5:
                last[0] = time.perf_counter()
                print(f"  convert {layout}/{type}: {stage} {done}/{total}", flush=True)

        convert(model_dir, out, layout=layout, type=type, progress=progress)
        print(f"  converted {out.name} in {time.perf_counter() - t0:.0f} s ({out.stat().st_size / 2**20:.0f} MiB)")
    return out


def make_prefill(n_prefill: int, n_prompt_speech: int, seed: int = 0) -> tuple[Prefill, int]:
    """A prompt of ``n_prefill`` positions: text ids (with <|endofprompt|>) + prompt speech tokens."""
    g = torch.Generator().manual_seed(seed)
    n_text = n_prefill - 2 - n_prompt_speech
    text = torch.randint(0, 151643, (n_text,), generator=g).tolist()
    text[n_text // 3] = ENDOFPROMPT
    speech = torch.randint(0, 6561, (n_prompt_speech,), generator=g).tolist()
    return Prefill(tuple(text), tuple(speech)), n_text


def run_once(backend, prefill: Prefill, n_decode: int, seed: int) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, tokens) for one forced-length generation."""
    opts = DecodeOptions(seed=seed, ignore_stop=True, min_len=n_decode, max_len=n_decode)
    dec = TokenDecoder(backend.config, 1, opts)
    t0 = time.perf_counter()
    handle, logp = backend.start(prefill, n_decode)
    t1 = time.perf_counter()
    n = 0
    try:
        while True:
            tok = dec.choose(logp)
            if tok is None:
                break
            n += 1
            if dec.done:
                break
            (logp,) = backend.step([(handle, tok)])
    finally:
        backend.release(handle)
    return t1 - t0, time.perf_counter() - t1, n


def summarize(name: str, runs: list[tuple[float, float, int]], prefill: Prefill, stat: str) -> dict:
    pick = min if stat == "best" else statistics.median
    pre = pick(r[0] for r in runs)
    dec = pick(r[1] for r in runs)
    n = runs[0][2]
    row = {"prefill_tokens": len(prefill), "decode_tokens": n, "prefill_s": pre, "decode_s": dec,
           "tokens_per_s": n / dec, "rtf": (pre + dec) / (n / TOKENS_PER_SECOND)}
    print(f"{name:<28} prefill {pre * 1000:7.0f} ms  decode {n / dec:7.1f} tok/s  LLM RTF {row['rtf']:.3f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="model directory (default: <cache>/model, made if missing)")
    ap.add_argument("--cache", type=Path, default=default_cache())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layouts", default="speech,merged")
    ap.add_argument("--types", default="F16,Q8_0,Q4_K_M")
    ap.add_argument("--prefill", type=int, default=150, help="prefill positions (sos, text, task, prompt speech)")
    ap.add_argument("--prompt-speech", type=int, default=100, help="of which prompt speech tokens")
    ap.add_argument("--decode", type=int, default=250, help="forced number of generated tokens")
    ap.add_argument("--repeat", type=int, default=3, help="rounds over all configurations")
    ap.add_argument("--stat", choices=["best", "median"], default="best",
                    help="per configuration: fastest round (robust to other load) or the median")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--n-batch", type=int, default=None, help="llama.cpp n_batch/n_ubatch")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--kv-type", default=None, help="llama.cpp KV cache type (default: f16 for quantized files)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f} (other processes on these cores skew every number)")
    model_dir = ensure_model(args.model_dir or args.cache / "model")
    prefill, _ = make_prefill(args.prefill, args.prompt_speech)
    # All backends stay loaded and the rounds interleave them, so a burst of load from other
    # processes hits every configuration alike; --stat best then reports each one's quietest run.
    configs: list[tuple[dict, object]] = []
    if not args.no_torch:
        from cosyllama.llm.torch_backend import TorchLLM
        configs.append(({"backend": "torch", "layout": None, "type": "F32"}, TorchLLM.from_dir(model_dir)))
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    fa = {"auto": None, "on": True, "off": False}[args.flash_attn]
    extra = {"n_batch": args.n_batch} if args.n_batch else {}
    for layout in args.layouts.split(","):
        for type in args.types.split(","):
            path = ensure_gguf(model_dir, args.cache / "gguf", layout, type)
            b = LlamaCppLLM(path, model_dir, n_threads=args.threads, kv_type=args.kv_type, flash_attn=fa,
                            n_seq_max=1, **extra)
            configs.append(({"backend": "llamacpp", "layout": layout, "type": type}, b))
    runs: list[list] = [[] for _ in configs]
    for _, b in configs:
        run_once(b, prefill, 8, seed=1)  # warm-up: first touch of the weights, graph allocation
    for r in range(args.repeat):
        for i, (_, b) in enumerate(configs):
            runs[i].append(run_once(b, prefill, args.decode, seed=0))
        print(f"round {r + 1}/{args.repeat} done (load average {os.getloadavg()[0]:.2f})", flush=True)
    rows = []
    for (meta, b), rs in zip(configs, runs):
        name = "torch fp32" if meta["backend"] == "torch" else f"llama.cpp {meta['layout']} {meta['type']}"
        rows.append({**meta, **summarize(name, rs, prefill, args.stat)})
        if hasattr(b, "close"):
            b.close()

    torch_row = next((r for r in rows if r["backend"] == "torch"), None)
    print(f"\n{'backend':<10} {'layout':<7} {'type':<7} {'prefill':>7} {'decode':>6} {'tok/s':>7} {'LLM RTF':>8} "
          f"{'vs torch':>8} {'speech/merged':>13}")
    for r in rows:
        vs = f"{r['tokens_per_s'] / torch_row['tokens_per_s']:.1f}x" if torch_row else "-"
        sm = "-"
        if r["layout"] == "speech":
            m = next((x for x in rows if x["layout"] == "merged" and x["type"] == r["type"]), None)
            sm = f"{r['tokens_per_s'] / m['tokens_per_s']:.2f}x" if m else "-"
        print(f"{r['backend']:<10} {r['layout'] or '-':<7} {r['type']:<7} {r['prefill_tokens']:>7} "
              f"{r['decode_tokens']:>6} {r['tokens_per_s']:>7.1f} {r['rtf']:>8.3f} {vs:>8} {sm:>13}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        out = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "gpu": None},
               "llm": rows}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
