"""One bf16 attention of the flow's shape (both CFG rows, the full model's 16 heads of 64 channels) on PyTorch's
kernel and on cosyllama's bf16 kernel, at several frame counts, timed in alternation; prints each best and the
ratio, and the kernel's error against a float64 attention of the same inputs beside PyTorch's.

    python scripts/bench_attention.py --threads 2 --frames 150,356,650,1300
"""

from __future__ import annotations

import argparse
import json

import torch

from cosyllama.flow import native_attention


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--frames", default="150,356,650,1300", help="comma list of frame counts (150 frames: 3 s)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim-head", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    lib, why = native_attention.library()
    if lib is None:
        print(f"the bf16 attention kernel cannot run here: {why}")
        return 1
    rows = []
    print(f"{'frames':>7}{'PyTorch ms':>12}{'kernel ms':>11}{'ratio':>8}{'GFLOP/s':>9}"
          f"{'max err kernel':>16}{'max err PyTorch':>17}")
    for frames in (int(x) for x in a.frames.split(",")):
        secs = native_attention.timed_calls(frames, a.heads, a.dim_head, a.rounds)
        q, k, v = native_attention._inputs(frames, a.heads, a.dim_head)
        exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) * a.dim_head ** -0.5, -1) @ v.double()
        err_kernel = float((native_attention.attention(q, k, v).double() - exact).abs().max())
        err_torch = float((native_attention.pytorch_call(q, k, v)().double() - exact).abs().max())
        flops = 2 * 2 * 2 * a.heads * frames * frames * a.dim_head  # two products, both CFG rows
        row = {"frames": frames, "pytorch_s": secs["pytorch"], "kernel_s": secs["kernel"],
               "ratio": secs["pytorch"] / secs["kernel"], "kernel_gflops": flops / secs["kernel"] / 1e9,
               "max_err_kernel": err_kernel, "max_err_pytorch": err_torch}
        rows.append(row)
        print(f"{frames:>7}{1e3 * row['pytorch_s']:>12.2f}{1e3 * row['kernel_s']:>11.2f}{row['ratio']:>7.2f}x"
              f"{row['kernel_gflops']:>9.0f}{err_kernel:>16.5f}{err_torch:>17.5f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "heads": a.heads, "dim_head": a.dim_head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
