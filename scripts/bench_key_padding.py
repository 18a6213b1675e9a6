"""Time PyTorch's CPU attention on a streaming flow call's shapes with the keys as they are and padded to a
whole number of ``KEY_ALIGN`` (16) frames, the padding hidden by the block mask (what the fast flow solver does,
cosyllama.flow.fast_dit.KEY_ALIGN): for each key count from ``--keys`` to ``--keys`` + 15, best of three
timings of each, and the means over the 16 (every remainder once). ``--whole``: a whole (non-streaming) call's
shapes instead, as many queries as keys and no mask, against the padded keys with the mask that hides them.

    python scripts/bench_key_padding.py --threads 2 --queries 100 --keys 200 [--dtype bfloat16] [--json FILE]
    python scripts/bench_key_padding.py --threads 2 --whole --keys 400 [--step 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cosyllama.flow.cache import joined
from cosyllama.flow.dit import chunk_attention_mask
from cosyllama.flow.fast_dit import KEY_ALIGN

HEADS, HEAD_DIM, CFG_ROWS, BLOCK = 16, 64, 2, 50  # the full-size DiT's attention, both CFG rows, its mask blocks


def per_call_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--queries", type=int, default=100, help="the frames the call computes")
    p.add_argument("--keys", type=int, default=200, help="the first of the 16 key counts")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--whole", action="store_true", help="a whole call: queries = keys, no mask unpadded")
    p.add_argument("--step", type=int, default=1, help="time every STEP-th of the 16 key counts")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--json", help="write the timings here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype, dim, g = getattr(torch, a.dtype), HEADS * HEAD_DIM, torch.Generator().manual_seed(0)
    rows = {}

    def heads(x):  # (B, N, dim) -> (B, H, N, D) view, as the solver hands them over
        return x.unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)

    for n in range(a.keys, a.keys + KEY_ALIGN, a.step):
        queries = n if a.whole else a.queries
        pad = (-n) % KEY_ALIGN
        q = heads(torch.randn(CFG_ROWS, queries, dim, generator=g).to(dtype))
        k, v = (torch.randn(CFG_ROWS, n, dim, generator=g).to(dtype) for _ in range(2))
        kp, vp = heads(joined(None, k, pad)), heads(joined(None, v, pad))
        k, v = heads(k), heads(v)
        mask = None if a.whole else chunk_attention_mask(n, BLOCK)[n - queries:]
        visible = torch.ones(queries, n, dtype=torch.bool) if mask is None else mask
        # the unpadded call's boolean mask as the solver had it, the padded one's additive as it has it now
        maskp = torch.zeros(queries, n + pad, dtype=dtype).masked_fill_(~F.pad(visible, (0, pad)), float("-inf"))
        plain = min(per_call_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), a.reps)
                    for _ in range(3))
        padded = min(per_call_ms(lambda: F.scaled_dot_product_attention(q, kp, vp, attn_mask=maskp), a.reps)
                     for _ in range(3))
        rows[n] = {"plain_ms": round(plain, 4), "padded_ms": round(padded, 4)}
        print(f"{n} keys: {plain:.3f} ms, padded to {n + pad}: {padded:.3f} ms")
    mean = {k: sum(r[k] for r in rows.values()) / len(rows) for k in ("plain_ms", "padded_ms")}
    shape = "as many queries (a whole call)" if a.whole else f"{a.queries} queries"
    print(f"mean over {len(rows)} key counts, {shape}, {a.dtype}, {a.threads} threads: "
          f"{mean['plain_ms']:.3f} ms as they are, {mean['padded_ms']:.3f} ms padded")
    if a.json:
        Path(a.json).write_text(json.dumps({"queries": "keys" if a.whole else a.queries, "dtype": a.dtype,
                                            "threads": a.threads, "rows": rows, "mean": mean}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
