"""What this machine can do at best: the ceilings behind the speed targets.

Measures, in one run:

* memory read bandwidth (sum over a 1 GiB float32 tensor, 1 and all threads, best of ``--repeats``);
* matrix-product throughput at the DiT's real shapes (2 CFG rows x 650 frames against the block
  matrices of Fun-CosyVoice3-0.5B), float32 and bfloat16, through the same pre-packed oneDNN
  linear that the flow's bf16 solver uses (AMX tiles on an AMX CPU), and int8 through the int8 flow's
  kernel (the dynamic linear: activations quantized on each call, included) and through the int8
  product with the activations quantized beforehand (the int8 peak the flow's products can approach),
  on each of PyTorch's int8 engines (fbgemm; oneDNN, AMX-INT8 on an AMX CPU);
* the DiT's attention (SDPA over 650 frames, 16 heads of 64, both CFG rows), float32 and bfloat16,
  full and with the streaming block mask;

and turns them into lower bounds:

* LLM decode: every weight of every layer is read once per token (the token table only one row),
  so ``tokens/s <= bandwidth / bytes per token``; bytes per token come from each GGUF's tensors;
* flow: the DiT's matrix products for 3 s prompt + 10 s output (10 Euler steps, batch of 2 for
  classifier-free guidance) at each measured throughput, plus its attention at the measured SDPA
  throughput (bf16 for the bf16 solver, float32 for the others): the floor; norms and glue come on top.

    python scripts/roofline.py                                  # GGUFs from `cosyllama bench`'s cache
    python scripts/roofline.py --gguf a.gguf --gguf b.gguf --json roofline.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cosyllama.cpu import has_native_bf16, onednn_bf16_reorder_ok
from cosyllama.timing import best_of
from cosyllama.tools.synthetic import SIZES

TOKEN_RATE = 25  # speech tokens per second of audio
MEL_RATE = 50  # mel frames per second


def read_bandwidth(threads: int, repeats: int) -> float:
    """GB/s of a streaming read (a sum over 1 GiB) with ``threads`` threads."""
    torch.set_num_threads(threads)
    a = torch.ones(1 << 28, dtype=torch.float32)
    t = best_of(lambda: a.sum(), repeats)
    return a.numel() * 4 / t / 1e9


def dit_shapes() -> list[tuple[int, int]]:
    """(in, out) of the matrix products of one DiT block: fused q/k/v, out, feed-forward in/out."""
    s = SIZES["full"]
    d, ff = s.dit_dim, s.dit_dim * 2
    return [(d, 3 * d), (d, d), (d, ff), (ff, d)]


def gemm_gflops(dtype: torch.dtype, rows: int, threads: int, repeats: int) -> tuple[float, str]:
    """Throughput of one DiT block's matrix products on ``rows`` rows, and the kernel that ran.

    The pre-packed oneDNN linear (what the flow's bf16 solver uses) where this CPU and PyTorch build
    offer it for ``dtype``; elsewhere (e.g. bf16 on an AVX2-only CPU, which oneDNN refuses to pack)
    plain ``torch.nn.functional.linear``, which is what runs there instead."""
    torch.set_num_threads(threads)
    shapes = []
    flops = 0
    for k, n in dit_shapes():
        shapes.append((torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype), torch.zeros(n, dtype=dtype)))
        flops += 2 * rows * k * n
    try:
        if dtype == torch.bfloat16 and not onednn_bf16_reorder_ok():
            raise RuntimeError("oneDNN has no bf16 kernels on this CPU (AVX-NE-CONVERT, or AVX-512 BW + VL + DQ)")
        ops = [(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b) for x, w, b in shapes]
        torch.ops.mkldnn._linear_pointwise(*ops[0], "none", [], "")
        kernel = "oneDNN packed linear"

        def run():
            for x, p, b in ops:
                torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        kernel = f"F.linear (oneDNN packing unavailable: {str(e).splitlines()[0][:120]})"

        def run():
            for x, w, b in shapes:
                torch.nn.functional.linear(x, w, b)

    return flops / best_of(run, repeats) / 1e9, kernel


def attention_tflops(dtype: torch.dtype, frames: int, threads: int, repeats: int, block: int = 0) -> float:
    """Throughput of the DiT's attention (SDPA, both CFG rows, all heads) over ``frames`` frames in ``dtype``,
    in TFLOP/s counting QK^T and PV; ``block``: the streaming block-causal mask of that many frames."""
    from cosyllama.flow.dit import chunk_attention_mask

    torch.set_num_threads(threads)
    s = SIZES["full"]
    heads, dh = s.dit_heads, s.dit_dim // s.dit_heads
    q, k, v = (torch.randn(2, heads, frames, dh).to(dtype) for _ in range(3))
    mask = chunk_attention_mask(frames, block, q.device) if block else None
    t = best_of(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), repeats)
    return 2 * 2 * 2 * heads * frames * frames * dh / t / 1e12


def int8_gemm_gops(rows: int, threads: int, repeats: int, engine: str = "fbgemm") -> dict[str, float]:
    """int8 throughput (GOP/s, one multiply-add = 2 ops) of one DiT block's products on ``rows`` rows:
    ``dynamic`` = what the int8 flow runs (:class:`cosyllama.flow.fast_dit._Int8Linear`: quantizing
    the float32 activations, the int8 product, float32 out); ``prequantized`` = fbgemm's product on
    activations already quantized (u8 in, float32 out): the kernel alone."""
    import warnings

    from cosyllama.flow import fast_dit

    torch.set_num_threads(threads)
    layers, flops = [], 0
    for k, n in dit_shapes():
        lin = fast_dit._Int8Linear(torch.randn(n, k) / k ** 0.5, torch.zeros(n), engine=engine)
        layers.append((torch.randn(rows, k), lin))
        flops += 2 * rows * k * n
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        qx = [torch.quantize_per_tensor(x, float(x.abs().max()) / 63, 64, torch.quint8) for x, _ in layers]
    out = {"dynamic": flops / best_of(lambda: [lin(x) for x, lin in layers], repeats) / 1e9}
    try:  # static int8 linear: u8 in, int8 product, requantized u8 out (no float pass on either side)
        out["prequantized"] = flops / best_of(
            lambda: [torch.ops.quantized.linear(q, lin.packed, 1.0, 0) for q, (_, lin) in zip(qx, layers)],
            repeats) / 1e9
    except (RuntimeError, AttributeError):
        pass
    return out


def flow_gemm_seconds_per_audio_s(gflops: float, prompt_s: float, output_s: float, steps: int = 10) -> dict:
    s = SIZES["full"]
    frames = round((prompt_s + output_s) * MEL_RATE)
    macs_block = sum(k * n for k, n in dit_shapes())
    gemm = 2.0 * steps * 2 * frames * s.dit_depth * macs_block  # FLOPs: 2 CFG rows
    attn = 2.0 * steps * 2 * s.dit_depth * 2 * frames * frames * s.dit_dim  # QK^T and PV
    return {"frames": frames, "gemm_tflop": gemm / 1e12, "attention_tflop": attn / 1e12,
            "gemm_bound_s_per_audio_s": gemm / (gflops * 1e9) / output_s}


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes read per decoded token: all tensors but the token table, plus one row of it."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n //= int(t.shape[-1]) if len(t.shape) > 1 else 1  # rows are the last axis in gguf-py
        total += n
    return total


def default_ggufs() -> list[Path]:
    from cosyllama.tools.bench_setup import full_model_dir, gguf_path

    return sorted(gguf_path(full_model_dir(), "speech", "F16").parent.glob("llm-*.gguf"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gguf", type=Path, action="append", help="GGUF files (default: the bench cache's)")
    ap.add_argument("--prompt-s", type=float, default=3.0)
    ap.add_argument("--output-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from cosyllama.cpu import CpuPath

    res: dict = {"threads": args.threads, "machine": CpuPath(threads=args.threads, llm="torch").as_dict()}
    print(CpuPath(threads=args.threads, llm="torch").lines()[0])
    res["read_gb_s"] = {str(t): round(read_bandwidth(t, args.repeats), 1) for t in sorted({1, args.threads})}
    bw = max(res["read_gb_s"].values())
    rows = 2 * round((args.prompt_s + args.output_s) * MEL_RATE)
    res["gemm_gflops"], res["gemm_kernel"] = {}, {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        g, kernel = gemm_gflops(dt, rows, args.threads, args.repeats)
        res["gemm_gflops"][name], res["gemm_kernel"][name] = round(g, 1), kernel
        if not kernel.startswith("oneDNN"):
            print(f"{name}: {kernel}; measured that instead")
    from cosyllama.precision import int8_available

    if int8_available():
        for engine in ("fbgemm", "onednn"):
            if engine not in torch.backends.quantized.supported_engines:
                continue
            for name, g in int8_gemm_gops(rows, args.threads, args.repeats, engine).items():
                label = f"int8-{engine}-{name}" if engine != "fbgemm" else f"int8-{name}"
                res["gemm_gflops"][label] = round(g, 1)
                res["gemm_kernel"][label] = engine + (" dynamic linear (the int8 flow's)" if name == "dynamic"
                                                      else " static linear on pre-quantized u8")
    if not has_native_bf16():
        print("bf16: this CPU has no native bf16 (AVX512-BF16/AMX): the bf16 figure is emulation, "
              "which is why --precision auto does not pick it here (int8 if it passes its check, else fp32)")
    res["flow"] = {name: flow_gemm_seconds_per_audio_s(g, args.prompt_s, args.output_s)
                   for name, g in res["gemm_gflops"].items()}
    frames = rows // 2
    res["attention_tflops"] = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for mask, block in (("full", 0), ("block-causal", 50)):  # the official DiT's 50-frame blocks
            tflops = attention_tflops(dt, frames, args.threads, args.repeats, block)
            res["attention_tflops"][f"{name}-{mask}"] = round(tflops, 3)
    # The flow's floor at each solver's products and attention: bf16 (products and attention bf16), int8 (its
    # products, float32 attention), fp32.
    for name, attn in (("fp32", "fp32-full"), ("bf16", "bf16-full"), ("int8-dynamic", "fp32-full"),
                       ("int8-onednn-dynamic", "fp32-full")):
        if name in res["flow"]:
            f = res["flow"][name]
            f["attention_s_per_audio_s"] = f["attention_tflop"] / res["attention_tflops"][attn] / args.output_s
            f["floor_s_per_audio_s"] = f["gemm_bound_s_per_audio_s"] + f["attention_s_per_audio_s"]
    print(f"memory read: {res['read_gb_s']} GB/s (by threads)")
    print(f"DiT matrix products ({rows} rows): {res['gemm_gflops']} GFLOP/s (int8: GOP/s)")
    print(f"attention (SDPA, {frames} frames, both CFG rows): {res['attention_tflops']} TFLOP/s")
    for name, f in res["flow"].items():
        floor = (f" + attention {f['attention_s_per_audio_s']:.2f} = floor {f['floor_s_per_audio_s']:.2f}"
                 if "floor_s_per_audio_s" in f else "")
        print(f"flow {name}: {f['gemm_tflop']:.2f} TFLOP of matrix products (+{f['attention_tflop']:.2f} attention) "
              f"for {args.output_s:g} s -> >= {f['gemm_bound_s_per_audio_s']:.2f} s per audio second{floor}")
    res["llm"] = {}
    for path in args.gguf or default_ggufs():
        b = gguf_bytes_per_token(path)
        tok_s = bw * 1e9 / b
        res["llm"][path.name] = {"mb_per_token": round(b / 1e6, 1), "max_tokens_per_s": round(tok_s, 1),
                                 "min_llm_rtf_decode": round(TOKEN_RATE / tok_s, 3)}
        print(f"{path.name}: {b / 1e6:.0f} MB per token -> <= {tok_s:.0f} tokens/s "
              f"(decode-only LLM RTF >= {TOKEN_RATE / tok_s:.3f}) at {bw:.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
