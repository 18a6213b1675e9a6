"""What bounds the flow on this CPU: the DiT's products per kind of int8 kernel against bf16, its attention
per kernel and precision, and where one flow call's time goes per precision variant.

    python scripts/flow_ceiling.py --threads 2 [--parts products,attention,profile] [--json FILE]

* ``products``: one DiT layer's four products (qkv, attention out, feed-forward in with GELU, out) at the
  rows of one non-streaming call (CFG pair x prompt + output frames): bf16 on oneDNN (the bf16 path),
  PyTorch's dynamic int8 linear on fbgemm and oneDNN (the int8 paths: activation range and
  quantization inside the kernel), and static activation scales on oneDNN's ``qlinear_pointwise``
  (products alone, then with the separate quantization pass a static scale needs, the engine's own
  :func:`~cosyllama.flow.fast_dit.quantize_u8`); then the feed-forward
  pair as a chain, the one place in a DiT block where a product's output feeds the next product with
  nothing but GELU between them: bf16, dynamic int8, and static int8 whose first product requantizes in
  its epilogue (GELU and the second product's input scale as oneDNN post-ops, uint8 out), so only the
  chain's input needs a quantization pass;
* ``attention``: the DiT's attention at that length, PyTorch's CPU flash kernel in fp32 and bf16,
  explicit bf16 ``matmul`` + ``softmax`` + ``matmul``, and the flash kernel under ``torch.compile``
  (``--no-compile``: not that one);
* ``profile``: one flow call per variant (``--variants``, default bf16, int8-onednn, int8-onednn+bf16,
  int8-onednn+bf16+static),
  self CPU time by kind of op (torch.profiler).

The bf16 rows (oneDNN's packed bf16 linear) run where oneDNN has bf16 kernels
(:func:`cosyllama.cpu.onednn_bf16_reorder_ok`: AVX-NE-CONVERT, or AVX-512 BW + VL + DQ); elsewhere the script
says it left them out (``left_out`` in the JSON) and runs the rest. Without VNNI the static int8 rows time the
kernel that runs there, whose u8 x s8 pair sums saturate (:func:`cosyllama.cpu.has_vnni`): their errors are not
the static engine's (which refuses such a CPU).

Numbers are for the machine it runs on; docs/benchmarks.md has them per CPU class.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from cosyllama.cpu import onednn_bf16_reorder_ok
from cosyllama.timing import best_of

PARTS = ("products", "attention", "profile")
def _ms(fn, n: int) -> float:
    """Best of 3 rounds of ``n`` calls, ms per call (after a warm-up round)."""
    return best_of(lambda: [fn() for _ in range(n)], 3) / n * 1e3


BF16_LEFT_OUT = ("bf16 rows (oneDNN's packed bf16 linear): left out, oneDNN has no bf16 kernels on this CPU "
                 "(it needs AVX-NE-CONVERT, or AVX-512 BW + VL + DQ)")


def products(cfg, rows: int, n: int) -> list[dict]:
    from cosyllama.flow.fast_dit import _StaticInt8Linear, quantize_u8

    bf16 = onednn_bf16_reorder_ok()

    d, ff = cfg.dit_dim, cfg.dit_dim * cfg.dit_ff_mult
    shapes = [("qkv", d, 3 * d, False), ("attention out", d, d, False), ("ff in + GELU", d, ff, True),
              ("ff out", ff, d, False)]
    g = torch.Generator().manual_seed(0)
    out = []
    for name, k, m, gelu in shapes:
        w, b = torch.randn(m, k, generator=g) * 0.05, torch.randn(m, generator=g) * 0.01
        x = torch.randn(rows, k, generator=g)
        xb = x.bfloat16()
        post = ("gelu", [], "tanh") if gelu else ("none", [], "")
        row = {"product": name, "rows": rows, "k": k, "n": m}
        if bf16:
            wp, bb = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None), b.bfloat16()
            row["bf16_ms"] = _ms(lambda: torch.ops.mkldnn._linear_pointwise(xb, wp, bb, *post), n)
        scale = (w.abs().amax(1) / 127).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros(m, dtype=torch.long), 0, torch.qint8)
            for engine in ("fbgemm", "onednn"):
                if engine not in torch.backends.quantized.supported_engines:
                    continue
                torch.backends.quantized.engine = engine
                packed = torch.ops.quantized.linear_prepack(qw, b)
                row[f"dynamic_{engine}_ms"] = _ms(lambda: torch.ops.quantized.linear_dynamic(x, packed, False), n)
        xq = (float(x.abs().max() / 127.0), 128)
        lin = _StaticInt8Linear(w, b, gelu)  # the static engine's product (epilogue GELU included)
        qx = quantize_u8(x, *xq)
        row["static_products_only_ms"] = _ms(lambda: lin(qx, xq, torch.bfloat16), n)
        row["static_with_quantize_ms"] = _ms(lambda: lin(quantize_u8(x, *xq), xq, torch.float32), n)
        out.append(row)
        if name == "ff in + GELU":
            first = (w, b, x, xq)
    out.append(_ff_chain(cfg, rows, n, first, g))
    return out


def _ff_chain(cfg, rows: int, n: int, first, g) -> dict:
    """The feed-forward pair timed as one chain (see the module's doc), on the int8 engines' own products."""
    from cosyllama.flow.fast_dit import _Int8Linear, _StaticInt8Linear, quantize_u8

    d, ff = cfg.dit_dim, cfg.dit_dim * cfg.dit_ff_mult
    w1, b1, x, xq = first
    w2, b2 = torch.randn(d, ff, generator=g) * 0.05, torch.randn(d, generator=g) * 0.01
    h = F.gelu(x @ w1.T + b1, approximate="tanh")
    hq = (float(h.abs().max() / 127.0), 128)  # the second product's static input scale, calibrated on h
    with_bf16 = onednn_bf16_reorder_ok()
    if with_bf16:
        xb = x.bfloat16()
        p1, p2 = (torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in (w1, w2))
        bf1, bf2 = b1.bfloat16(), b2.bfloat16()
        pw = torch.ops.mkldnn._linear_pointwise
    d1, d2 = _Int8Linear(w1, b1, gelu=True, engine="onednn"), _Int8Linear(w2, b2, engine="onednn")
    s1, s2 = _StaticInt8Linear(w1, b1, gelu=True), _StaticInt8Linear(w2, b2)

    def bf16():
        return pw(pw(xb, p1, bf1, "gelu", [], "tanh"), p2, bf2, "none", [], "")

    def dynamic():
        return d2(d1(x))

    def static():
        return s2(s1(quantize_u8(x, *xq), xq, torch.uint8, hq), hq, torch.bfloat16)

    row = {"product": "ff chain", "rows": rows, "k": d, "n": d}
    runs = [("bf16", bf16)] if with_bf16 else []
    runs += [("dynamic_onednn", dynamic), ("static_int8_epilogue", static)]
    for key, fn in runs:
        row[f"{key}_ms"] = _ms(fn, n)
    ref = h @ w2.T + b2
    for key, fn in runs:
        row[f"{key}_max_error"] = float((fn().float() - ref).abs().max())
    return row


def attention(cfg, frames: int, n: int, compile_too: bool = True) -> list[dict]:
    h, dh = cfg.dit_heads, cfg.dit_dim_head
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, h, frames, dh, generator=g).to(dtype) for _ in range(3))
        row = {"dtype": str(dtype).removeprefix("torch."), "batch": 2, "heads": h, "frames": frames,
               "flash_ms": _ms(lambda: F.scaled_dot_product_attention(q, k, v), n)}
        if dtype == torch.bfloat16:
            row["matmul_softmax_matmul_ms"] = _ms(
                lambda: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * dh ** -0.5, -1), v), n)
            if compile_too:  # inductor needs a C++ compiler
                compiled = torch.compile(F.scaled_dot_product_attention, dynamic=False)
                compiled(q, k, v)
                row["flash_compiled_ms"] = _ms(lambda: compiled(q, k, v), n)
        row["gflop_per_s"] = 4 * 2 * h * frames ** 2 * dh / row["flash_ms"] / 1e6
        out.append(row)
    return out


def profile(model_dir: Path, variants: list[str], prompt_s: float, output_s: float) -> list[dict]:
    from cosyllama.config import load_config
    from cosyllama.flow import Flow
    from cosyllama.tools.bench_flow import FLOW_OP_KINDS, FlowVariant, _inputs, op_seconds

    config = load_config(model_dir)
    dev = torch.device("cpu")
    tokens, pt, pf, emb = _inputs(config, prompt_s, output_s, torch.Generator().manual_seed(0), dev)
    flow = Flow.from_config(config, dev)
    out = []
    for name in variants:
        v = FlowVariant.parse(name)
        if v is None or not v.available():
            continue
        v.apply(flow)
        with v.running(dev):
            flow.inference(tokens[:, :10], pt, pf, emb)
            t0 = time.perf_counter()
            flow.inference(tokens, pt, pf, emb)
            wall = time.perf_counter() - t0
            spent = op_seconds(lambda: flow.inference(tokens, pt, pf, emb), FLOW_OP_KINDS, dev)
        kinds = {k: t / output_s for k, t in spent.items() if t > 0}
        out.append({"variant": name, "seconds_per_audio_second": wall / output_s,
                    "self_cpu_seconds_per_audio_second": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="model directory (default: the cached full-size random model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--variants", default="bf16,int8-onednn,int8-onednn+bf16,int8-onednn+bf16+static")
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--output-seconds", type=float, default=10.0)
    p.add_argument("--calls", type=int, default=20, help="calls per timing round of a product or an attention")
    p.add_argument("--no-compile", action="store_true", help="attention: skip the torch.compile row")
    p.add_argument("--json")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if any(x not in PARTS for x in parts):
        p.error(f"--parts: a comma list of {', '.join(PARTS)}")
    torch.set_num_threads(args.threads)
    from cosyllama.config import load_config
    from cosyllama.tools.bench_setup import ensure_full_model, machine_info

    model = Path(args.model_dir or ensure_full_model(print))
    cfg = load_config(model).flow
    frames = round((args.prompt_seconds + args.output_seconds) * 50)  # mel frames, 50 Hz
    res = {"machine": machine_info(args.threads), "frames": frames, "left_out": []}
    if "products" in parts:
        if not onednn_bf16_reorder_ok():
            res["left_out"].append(BF16_LEFT_OUT)
            print(BF16_LEFT_OUT)
        res["products"] = products(cfg, 2 * frames, args.calls)
        for r in res["products"]:
            ref = r.get("bf16_ms")  # the ratios are against bf16 where it ran
            print(f"{r['product']:14s} {r['rows']}x{r['k']}->{r['n']}: " + ", ".join(
                f"{k.removesuffix('_ms')} {r[k]:.2f} ms" + (f" ({ref / r[k]:.2f}x)" if ref and k != "bf16_ms" else "")
                for k in r if k.endswith("_ms")))
    if "attention" in parts:
        res["attention"] = attention(cfg, frames, args.calls, not args.no_compile)
        for r in res["attention"]:
            print(f"attention {r['dtype']} 2x{r['heads']}x{frames}: " + ", ".join(
                f"{k.removesuffix('_ms')} {r[k]:.2f} ms" for k in r if k.endswith("_ms"))
                + f" ({r['gflop_per_s']:.0f} GFLOP/s flash)")
    if "profile" in parts:
        res["profile"] = profile(model, [v.strip() for v in args.variants.split(",") if v.strip()],
                                 args.prompt_seconds, args.output_seconds)
        for r in res["profile"]:
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in r["self_cpu_seconds_per_audio_second"].items())
            print(f"flow {r['variant']}: {r['seconds_per_audio_second']:.3f} s per audio second; self CPU: {kinds}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
