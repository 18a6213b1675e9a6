"""What PyTorch's compiler would give the bf16 flow: one DiT block, eager against ``torch.compile``.

The block is the bf16 solver's arithmetic (modulated LayerNorm, fused q/k/v, SDPA, output projection, residual,
feed-forward) at full size (dim 1024, 16 heads, both CFG rows of 650 frames), with random weights. Inductor runs
with weight freezing (its oneDNN packing) in each ``--modes`` entry (``default``; ``max-autotune`` also tries
its AMX micro-kernels for the products). Reports each mode's compile time, the block's best time against eager
and the largest difference. A 22-block, 10-step flow runs the block 220 times per solve.

    python scripts/bench_flow_compile.py --modes default,max-autotune
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cosyllama.timing import best_of

D, H, N, B = 1024, 16, 650, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.ff1, self.ff2 = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)

    def forward(self, h, sc_a, sh_a, g_a, sc_f, sh_f, g_f):
        bf = torch.bfloat16
        n1 = F.layer_norm(h.to(bf), (D,), (1 + sc_a).to(bf), sh_a.to(bf), 1e-6)
        q, k, v = (t.unflatten(-1, (H, D // H)).transpose(1, 2) for t in self.qkv(n1).split(D, -1))
        o = self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        h = h + o.float() * g_a
        n2 = F.layer_norm(h.to(bf), (D,), (1 + sc_f).to(bf), sh_f.to(bf), 1e-6)
        return h + self.ff2(F.gelu(self.ff1(n2), approximate="tanh")).float() * g_f


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="default,max-autotune")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    blk = Block().to(torch.bfloat16).eval()
    inputs = (torch.randn(B, N, D), *[torch.randn(D) * 0.1 for _ in range(6)])
    with torch.no_grad():
        eager = best_of(lambda: blk(*inputs), args.repeats)
        ref = blk(*inputs)
        print(f"eager: {eager * 1e3:.2f} ms per block")
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            t0 = time.perf_counter()
            compiled = torch.compile(blk, mode=None if mode == "default" else mode)
            out = compiled(*inputs)
            setup = time.perf_counter() - t0
            t = best_of(lambda: compiled(*inputs), args.repeats)
            print(f"{mode}: compile {setup:.1f} s, {t * 1e3:.2f} ms per block ({eager / t:.2f}x eager), "
                  f"max diff {float((out - ref).abs().max()):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
