"""Aggregate LLM decode throughput of the batch scheduler: N concurrent streams vs one.

Runs requests of forced length (stop tokens ignored, seeded RAS) through a BatchScheduler over a
llama.cpp backend (or, without ``--gguf``, the PyTorch LLM) and reports tokens/s summed over all streams and per
stream. Use a full-size
model (``cosyllama make-model DIR --size full``; ``cosyllama convert --model-dir DIR --out F.gguf
--type Q8_0``) for meaningful numbers.

    python scripts/bench_concurrency.py --model-dir /tmp/cv3-full --gguf /tmp/cv3-full-q8.gguf --streams 1,4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from cosyllama.config import load_config
from cosyllama.llm.backend import Prefill
from cosyllama.llm.decode import DecodeOptions, generate
from cosyllama.llm.llamacpp_backend import LlamaCppLLM
from cosyllama.llm.scheduler import BatchScheduler

PROMPT_TEXT_TOKENS = 40  # prompt transcript + target text ids
PROMPT_SPEECH_TOKENS = 75  # 3 s of prompt speech at 25 tokens/s


def make_prefill(cfg, i: int) -> Prefill:
    """A plausible-size prompt; ids differ per stream so no two sequences are alike."""
    text = tuple((1000 + 37 * (i * PROMPT_TEXT_TOKENS + k)) % cfg.qwen.vocab_size for k in range(PROMPT_TEXT_TOKENS))
    speech = tuple((11 * (i * PROMPT_SPEECH_TOKENS + k)) % cfg.speech_token_size for k in range(PROMPT_SPEECH_TOKENS))
    return Prefill(text, speech)


def run_streams(sched: BatchScheduler, cfg, n: int, tokens: int) -> dict:
    """``n`` concurrent requests of ``tokens`` tokens each.

    tokens_per_s: all tokens / wall time from the first submit to the last token (prefills
    included). decode_tokens_per_s: tokens produced once every stream has its first token, divided
    by that window (the steady state where every step advances all ``n`` sequences).
    """
    stamps: list[list[float]] = [[] for _ in range(n)]
    barrier = threading.Barrier(n + 1)

    def one(i):
        opts = DecodeOptions(seed=i, max_len=tokens, ignore_stop=True)
        it = sched.generate(make_prefill(cfg, i), PROMPT_TEXT_TOKENS, opts)
        barrier.wait()
        for _ in it:
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    end = max(s[-1] for s in stamps)
    all_started = max(s[0] for s in stamps)
    steady = sum(1 for s in stamps for t in s if t > all_started)
    total = sum(len(s) for s in stamps)
    return {"streams": n, "tokens": total, "wall_s": end - t0, "tokens_per_s": total / (end - t0),
            "decode_tokens_per_s": steady / (end - all_started) if end > all_started else None,
            "first_token_s_max": all_started - t0}


def direct_decode_rate(llm, cfg, tokens: int) -> float:
    """Decode tokens/s of one request through plain ``generate`` (no scheduler), prefill excluded."""
    opts = DecodeOptions(seed=0, max_len=tokens, ignore_stop=True)
    it = generate(llm, make_prefill(cfg, 0), PROMPT_TEXT_TOKENS, opts)
    next(it)
    t0 = time.perf_counter()
    return sum(1 for _ in it) / (time.perf_counter() - t0)


def raw_step_ms(llm, cfg, batch: int, steps: int = 30) -> float:
    """Median wall time of one ``llm.step`` advancing ``batch`` sequences (no scheduler, no sampling):
    what llama.cpp itself gives for sharing a step, to compare with the scheduler's numbers."""
    seqs = [llm.start(make_prefill(cfg, i), steps + 8)[0] for i in range(batch)]
    try:
        for _ in range(3):
            llm.step([(s, 5) for s in seqs])
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            llm.step([(s, 5) for s in seqs])
            times.append(time.perf_counter() - t0)
    finally:
        for s in seqs:
            llm.release(s)
    times.sort()
    return 1000 * times[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--gguf", help="llama.cpp GGUF; without it the PyTorch LLM (float32) is measured")
    p.add_argument("--streams", default="1,4", help="comma-separated concurrent stream counts (default 1,4)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream (default 100)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeat", type=int, default=2, help="runs per level; the best is reported (default 2)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--device", default="cpu", help="torch LLM device (cuda: the static-cache CUDA-graph backend)")
    p.add_argument("--llm-precision", default="fp32", help="torch LLM precision on the static backend (fp32|bf16|fp16)")
    p.add_argument("--n-gpu-layers", type=int, default=0, help="llama.cpp layers on the GPU (999: all)")
    p.add_argument("--torch-thread", action="store_true",
                   help="first start a thread that runs one PyTorch matrix product and stays alive, as a server's "
                        "flow worker does (its OpenMP team then exists beside llama.cpp's)")
    p.add_argument("--raw-steps", action="store_true",
                   help="also time bare llama.cpp steps of each batch size from the main thread (after the levels)")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.streams.split(",")]
    stop = threading.Event()
    if args.torch_thread:
        ready = threading.Event()

        def torch_worker():
            import torch

            x = torch.randn(1024, 1024)
            x @ x
            ready.set()
            stop.wait()

        threading.Thread(target=torch_worker, daemon=True).start()
        ready.wait()
    cfg = load_config(args.model_dir).llm
    if args.gguf:
        llm = LlamaCppLLM(args.gguf, load_config(args.model_dir), n_threads=args.threads, n_seq_max=max(levels),
                          n_gpu_layers=args.n_gpu_layers)
    else:
        import torch

        from cosyllama.llm.factory import make_llm

        torch.set_num_threads(args.threads)
        llm = make_llm(load_config(args.model_dir), "torch", device=args.device, n_seq_max=max(levels),
                       llm_precision=args.llm_precision)
        llm.n_seq_max = max(levels)  # the scheduler's batch size
    rows = []
    try:
        # Everything that calls llama.cpp runs on the scheduler's worker thread first: llama.cpp's
        # OpenMP thread team belongs to the calling thread, and a second calling thread in the same
        # process (measured: the main thread running a reference first) slowed the worker's decode
        # by ~35 % on 2 vCPUs. The no-scheduler reference therefore comes last.
        print(f"{llm!r}\nprefill {len(make_prefill(cfg, 0))} positions, {args.tokens} tokens per stream, "
              f"best of {args.repeat}")
        print(f"{'streams':>7} {'tokens/s':>9} {'decode tok/s':>12} {'per stream':>10} {'wall s':>7} {'speed-up':>8}")
        with BatchScheduler(llm) as sched:
            run_streams(sched, cfg, 1, 8)  # warm-up
            for n in levels:
                row = max((run_streams(sched, cfg, n, args.tokens) for _ in range(args.repeat)),
                          key=lambda r: r["decode_tokens_per_s"] or 0)
                rows.append(row)
                base = rows[0]["decode_tokens_per_s"]
                print(f"{n:>7} {row['tokens_per_s']:>9.2f} {row['decode_tokens_per_s']:>12.2f} "
                      f"{row['decode_tokens_per_s'] / n:>10.2f} {row['wall_s']:>7.2f} "
                      f"{row['decode_tokens_per_s'] / base:>7.2f}x", flush=True)
            print(f"scheduler: max batch {sched.stats()['max_batch']}")
        direct = max(direct_decode_rate(llm, cfg, args.tokens) for _ in range(args.repeat))
        print(f"direct generate() afterwards from the main thread, 1 stream, decode only: {direct:.2f} tokens/s")
        raw = {}
        if args.raw_steps:
            raw = {n: raw_step_ms(llm, cfg, n) for n in levels}
            print("bare llama.cpp step, main thread: " + ", ".join(
                f"batch {n} {ms:.2f} ms ({n * raw[levels[0]] / (levels[0] * ms):.2f}x tokens/s vs batch {levels[0]})"
                for n, ms in raw.items()))
    finally:
        stop.set()
        if hasattr(llm, "close"):
            llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": repr(llm), "direct_tokens_per_s": direct,
                                               "raw_step_ms": raw, "levels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
