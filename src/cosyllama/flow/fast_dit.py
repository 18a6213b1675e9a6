"""The mixed-precision (bf16 / int8) Euler/CFG solver: the DiT's maths re-arranged over pre-packed
low-precision weight copies."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from ..precision import INT8
from . import native_attention
from .cache import FlowStreamCache, StepCache, joined
from .dit import CONV_POS_GROUPS, LN_EPS, CausalConvPositionEmbedding, DiT, chunk_attention_mask
from .native_attention import KEY_ALIGN


def _onednn_linear_available(dtype: torch.dtype) -> bool:
    """oneDNN's fused linear (pre-packed weights, bias and GELU in the kernel) is usable on this CPU (for bf16:
    :func:`cosyllama.cpu.onednn_bf16_reorder_ok`)."""
    from ..cpu import onednn_bf16_reorder_ok

    try:
        ops = torch.ops.mkldnn
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                and hasattr(ops, "_reorder_linear_weight")
                and (dtype != torch.bfloat16 or onednn_bf16_reorder_ok()))
    except (AttributeError, RuntimeError):
        return False


class _LowpLinear:
    """``x W^T + b`` (then GELU-tanh if ``gelu``) with weights held in ``dtype``. On CPU the weight is
    pre-packed once for oneDNN and bias/GELU run inside the matrix-product kernel; elsewhere plain
    ``F.linear``. Same result as ``F.linear`` on the ``dtype`` copies (up to GELU rounding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype, gelu: bool = False):
        self.gelu = gelu
        self.bias = bias.detach().to(dtype).contiguous()
        w = weight.detach().to(dtype).contiguous()
        self.packed = None
        if w.device.type == "cpu" and _onednn_linear_available(dtype):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            except RuntimeError:
                self.packed = None
        self.weight = None if self.packed is not None else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "gelu" if self.gelu else "none",
                                                      [], "tanh" if self.gelu else "")
        y = F.linear(x, self.weight, self.bias)
        return F.gelu(y, approximate="tanh") if self.gelu else y


# PyTorch's int8 kernel library for the dynamic linear: the default one. fbgemm and oneDNN ("onednn") ran at the
# same speed at the DiT's shapes on an AVX2 CPU; on Intel AMX oneDNN runs AMX-INT8 (2.3x fbgemm's products). `auto`
# times both where both exist (cosyllama.flow.auto); an explicit "int8" uses this one.
INT8_ENGINE = "fbgemm"
# "onednn+bf16" is the mixed path: int8 products on oneDNN (AMX-INT8 where the CPU has it) with the activations
# between them, attention, the K/V cache and the tail steps' products in bfloat16, where the other two keep float32
# (on AMX float32 attention alone costs more than the bf16 path's whole attention). Only on CPUs with native bf16.
# "onednn+bf16+static" is the mixed path with static activation scales (see _StaticInt8Linear): every product's
# input has one scale per block and Euler step, calibrated once on the loaded weights (cosyllama.flow.check.
# static_scales), so no product measures its input's range, and the feed-forward pair stays in int8 between its
# two products.
STATIC_ENGINE = "onednn+bf16+static"

INT8_ENGINES = ("fbgemm", "onednn", "onednn+bf16", STATIC_ENGINE)


def int8_library(engine: str) -> str:
    """PyTorch's quantized engine an int8 engine name runs on (``onednn+bf16`` -> ``onednn``)."""
    return engine.split("+", 1)[0]


def int8_is_mixed(engine: str) -> bool:
    """The int8 engine keeps everything but its int8 products in bfloat16."""
    return "bf16" in engine.split("+")[1:]


def int8_is_static(engine: str) -> bool:
    """The int8 engine quantizes activations with calibrated static scales (it needs them to be built)."""
    return engine.endswith("+static")


def _static_ops_available() -> bool:
    ops = getattr(torch.ops, "onednn", None)
    try:
        return ops is not None and hasattr(ops, "qlinear_pointwise") and hasattr(ops, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


def int8_engine_problem(engine: str, on_cpu: bool = True) -> str | None:
    """Why the int8 ``engine`` cannot run here (None: it can): unknown, not in this PyTorch build, static
    where the int8 products lack VNNI (whatever the device: see :data:`STATIC_NEEDS_VNNI`), or (``on_cpu``)
    mixed with bfloat16 on a CPU that only emulates it. The one rule for ``CFM`` (which refuses with it),
    ``auto``'s candidates, ``bench``'s variants (which leave such engines out) and the tests (which skip)."""
    from .. import precision  # looked up at call time: tests stand in for the CPU's bf16

    if engine not in INT8_ENGINES:
        return f"unknown int8 engine {engine!r}; allowed: {', '.join(INT8_ENGINES)}"
    built = torch.backends.quantized.supported_engines
    if int8_library(engine) not in built:
        return f"int8 engine {engine!r} is not in this PyTorch build (engines: {', '.join(built)})"
    if int8_is_static(engine) and not _static_ops_available():
        return f"int8 engine {engine!r} needs oneDNN's quantized linear, which this PyTorch build lacks"
    if int8_is_static(engine) and not precision.cpu_has_int8_vnni():
        return f"int8 engine {engine!r}: {STATIC_NEEDS_VNNI}"
    if on_cpu and int8_is_mixed(engine) and not precision.cpu_has_native_bf16():
        return (f"int8 engine {engine!r} computes in bfloat16, which this CPU only emulates; "
                f"use {', '.join(e for e in INT8_ENGINES if not int8_is_mixed(e))}")
    return None

# Why the static engine needs VNNI (int8_engine_problem): its activations use the full 8 bits at a scale fixed in
# advance, and its weights +-127, so a pair of adjacent products reaches 2 x 255 x 127 = 64770.
STATIC_NEEDS_VNNI = ("this CPU's int8 products lack VNNI: without it oneDNN adds each pair of u8 x s8 products "
                     "in int16, which saturates with full 8-bit activations (cosyllama.cpu.has_vnni)")

# Activations are quantized to 8 bits (u8), weights to 8 (+-127). On CPUs without VNNI the 8-bit
# dot product (vpmaddubsw) adds pairs of u8 x s8 products in int16, which can saturate (2 * 255 *
# 127 > 32767); 7-bit activations (True) avoid that. Measured on an AVX2 CPU: the tiny fixture model
# prefers 7 bits (worst mean 2.2e-3 vs 3.3e-3), the full-size random model 8 bits (the fidelity
# check's mel mean 0.0102 vs 0.0146), and only the full-size one is near the bound.
INT8_REDUCE_RANGE = False
# The int8 path runs its last this-many Euler steps with float32 products: the late steps take the
# largest time steps (cosine grid), so their product error reaches the mel most directly (measured
# on the full random model: int8 in steps 1-5 only gave a third of the mel error of int8 in 6-10;
# the fidelity check's mel mean: all 10 steps int8 0.0102, last 2 float32 0.0079, last 3 0.0066).
INT8_FP32_LAST_STEPS = 2
# Largest weight magnitude after quantization (per output channel); tests lower it to show that the
# fidelity bound catches a coarser scheme.
INT8_WEIGHT_MAX = 127


@contextlib.contextmanager
def _quant_engine(name: str):
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


class _Int8Linear:
    """``x W^T + b`` (then GELU-tanh if ``gelu``) on PyTorch's int8 dynamic linear (fbgemm): W
    quantized once, symmetric, one scale per output channel; x quantized on every call from its
    own min/max (one asymmetric scale per call, 8 bits, see ``INT8_REDUCE_RANGE``); int32
    accumulation, bias added in float32; float32 in and out.

    Per-call rather than per-row activation scales: at the DiT's shapes on an AVX2 CPU, normalising
    the rows first (and scaling the products back) cost 25-50 % of the int8 products' time in extra
    passes, for a mel error only ~20 % smaller (docs/benchmarks.md). So a row's result depends on
    the other rows of the call (the two CFG rows and the frames computed together) at the level of
    the quantization step; the streaming cache's frames then equal recomputed ones within that
    error, as at bf16, not bit for bit."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False, engine: str = INT8_ENGINE,
                 io_dtype: torch.dtype = torch.float32):
        self.gelu, self.io_dtype = gelu, io_dtype  # io_dtype: of x and of the result (the kernel's are float32)
        engine = int8_library(engine)
        w = weight.detach().float().cpu()
        n = w.shape[0]
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / INT8_WEIGHT_MAX).double()
        self.bias = bias.detach().float().contiguous()
        # PyTorch deprecates its quantized tensor type (the packing below takes one); the pinned
        # release has it, and the fidelity check falls back to fp32 if the path ever misbehaves.
        with warnings.catch_warnings(), _quant_engine(engine):
            warnings.filterwarnings("ignore", category=UserWarning)
            qw = torch.quantize_per_channel(w, scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qw, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float(), self.packed, INT8_REDUCE_RANGE)
        y = torch.ops.aten.gelu_(y, approximate="tanh") if self.gelu else y  # in place: y is ours
        return y.to(self.io_dtype)


def quantize_u8(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """``x`` as uint8 at a static scale (``round(x / scale) + zero_point``, clamped to 0..255),
    contiguous. PyTorch's native per-tensor quantization: one pass over float32 (bf16 is read through a
    float32 copy), about 10x faster here than the decomposed op PyTorch's graph-mode quantization uses
    (0.7 with int_repr's copy against 7.2 ms for 1300 x 1024 on 2 Zen 4 cores)."""
    with warnings.catch_warnings():  # the quantized tensor type is deprecated (see _Int8Linear)
        warnings.filterwarnings("ignore", category=UserWarning)
        q = torch.quantize_per_tensor(x.float(), scale, zero_point, torch.quint8)
    # The same bytes as a plain uint8 tensor, without int_repr's copy (0.6 of the 0.7 ms above): a
    # quint8 tensor's storage holds exactly the uint8 values (int_repr reads them from it).
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def static_steps(n_timesteps: int) -> int:
    """The Euler steps that have static scales: all but the bf16 tail (:data:`INT8_FP32_LAST_STEPS`)."""
    return max(0, n_timesteps - INT8_FP32_LAST_STEPS)


def static_scale(lo: float, hi: float) -> tuple[float, int]:
    """The uint8 scale and zero point that cover ``lo..hi`` (0 included: exact zeros stay exact)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max(hi - lo, 1e-8) / 255.0
    return scale, int(min(255, max(0, round(-lo / scale))))


class _StaticInt8Linear:
    """``x W^T + b`` (then GELU-tanh if ``gelu``) on oneDNN's static int8 linear: W quantized once as in
    :class:`_Int8Linear` (symmetric, per output channel); x arrives as uint8 at a static scale (one per
    block and Euler step, calibrated on the loaded weights); int32 accumulation; bias, GELU and the
    output's conversion in the kernel's epilogue. The output is float32/bf16, or uint8 at the next
    product's static input scale (the feed-forward pair: its hidden activations are never widened).

    Where the dynamic kernel scans its input for the range, quantizes and converts the result back on
    every call, here one quantization pass per product input remains (none between the feed-forward
    products). Rows no longer share a scale chosen from their values; a value outside the calibrated
    range saturates, which the fidelity check on the loaded weights would show."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False):
        w = weight.detach().float().cpu()
        self.w_scale = (w.abs().amax(dim=1).clamp_min(1e-12) / INT8_WEIGHT_MAX).contiguous()
        w8 = torch.round(w / self.w_scale[:, None]).clamp(-INT8_WEIGHT_MAX, INT8_WEIGHT_MAX).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(w8, None)
        self.w_zero = torch.zeros(w.shape[0], dtype=torch.int32)
        self.bias = bias.detach().float().contiguous()
        self.post = ("gelu", [], "tanh") if gelu else ("none", [], "")

    def __call__(self, q: torch.Tensor, x_q: tuple[float, int], out_dtype: torch.dtype,
                 out_q: tuple[float, int] = (1.0, 0)) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(q, x_q[0], x_q[1], self.packed, self.w_scale, self.w_zero,
                                                  self.bias, out_q[0], out_q[1], out_dtype, *self.post)


class _Fp32Linear:
    """``x W^T + b`` (then GELU-tanh) in float32 on the DiT's own parameters (no copy); a list of
    (W, b) pairs is computed as one product per pair and concatenated (the fused q/k/v)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], gelu: bool = False):
        self.pairs, self.gelu = pairs, gelu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [F.linear(x, w, b) for w, b in self.pairs]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return F.gelu(y, approximate="tanh") if self.gelu else y


def _observe(seen: list[list[float]] | None, k: int, x: torch.Tensor) -> None:
    """Widen ``seen[k]`` (a [lo, hi] range) to ``x``'s values (calibration only; ``seen`` None: not observing)."""
    if seen is not None:
        lo, hi = torch.aminmax(x)
        seen[k][0], seen[k][1] = min(seen[k][0], float(lo)), max(seen[k][1], float(hi))


class _LowpConvPos:
    """The DiT's causal conv position embedding with its two grouped convs in ``dtype`` (bfloat16):
    the same interface as :class:`~cosyllama.flow.dit.CausalConvPositionEmbedding` where the solver
    and :class:`~cosyllama.flow.cache.StepCache` call it (``conv1`` takes the float32 input projection
    channel-major and gives ``dtype``, ``conv2`` takes that and gives float32; calling it pads on the
    left as the module does). oneDNN's float32 grouped conv is slow (7 ms per conv for a streaming
    chunk's 166 frames on 2 AMX cores, 2.9 in bfloat16; 20 against 5.8 at 650 frames), and the
    bfloat16 paths round its input to bfloat16 downstream anyway. Mish runs in ``dtype`` too."""

    def __init__(self, cpe, dtype: torch.dtype):
        convs = [seq[0] for seq in (cpe.conv1, cpe.conv2)]
        self._w = [(c.weight.detach().to(dtype), c.bias.detach().to(dtype)) for c in convs]
        self.dtype = dtype

    def _conv(self, i: int, y: torch.Tensor) -> torch.Tensor:
        w, b = self._w[i]
        return F.mish(F.conv1d(y.to(self.dtype), w, b, groups=CONV_POS_GROUPS))

    def conv1(self, y: torch.Tensor) -> torch.Tensor:
        return self._conv(0, y)

    def conv2(self, y: torch.Tensor) -> torch.Tensor:
        return self._conv(1, y).float()

    # the module's own forward (left padding, the two convs through self.conv1/conv2): one definition of it
    __call__ = CausalConvPositionEmbedding.forward


class FastDiT:
    """The whole Euler/CFG solve with the DiT's matrix products in a low-precision ``dtype``.

    Same maths as :class:`CFM` + :class:`DiT`, re-arranged so that nothing is computed twice:

    * the time embedding and every block's AdaLN modulation depend only on t, which is the same for
      both CFG rows and fixed in advance, so all of them are computed once, for all steps, in float32
      (one matrix product per block instead of one per block per step), and kept for the next call
      (:meth:`_modulations`);
    * the input projection is linear, so its ``[cond, mu, spks]`` part (constant over the steps) is
      computed once; only the ``x`` part (the same for both CFG rows) is recomputed per step;
    * the rotary angles, their sin/cos and the attention mask are computed once;
    * q, k and v come from one fused matrix product; RoPE rotates only the 64 channels of head 0,
      in place; SDPA reads q/k/v as strided views (no head-split copies);
    * LayerNorm and its modulation are one ``layer_norm`` call with the (shared) scale/shift as its
      affine parameters.

    Precision: the weights of q/k/v, out, and the feed-forward are held in ``dtype`` (for
    :data:`~cosyllama.precision.INT8`: int8 weights on PyTorch's int8 kernels, see :class:`_Int8Linear`,
    and float32 everywhere else); LayerNorm
    statistics, the residual stream, the modulation, the input/output projections, the CFG
    combination and the Euler update stay float32. The conv position embedding runs in the
    activations' dtype (bfloat16 on the bf16 and mixed int8 paths, :class:`_LowpConvPos`; float32 on
    the other int8 paths). Noise in and mel out are float32. Not a module: a read-only view built
    from a loaded :class:`DiT`.

    Streaming cache: :meth:`solve_from` resumes from a :class:`FlowStreamCache` the way the
    reference DiT does (see :class:`StepCache`).
    """

    # The residual stream's dtype. float32; `cosyllama bench --flow-precisions bf16-res16` sets
    # bfloat16 around its own calls to measure what keeping it in float32 costs.
    residual_dtype = torch.float32
    # Switches for scripts/ab_first_chunk.py, which times each against its absence in one process: the
    # position convs in bfloat16 where the activations are (_LowpConvPos), the modulations kept per schedule.
    lowp_conv_pos = True
    keep_modulations = True
    # and the attention keys padded to KEY_ALIGN frames (see KEY_ALIGN), the bf16 attention kernel where chosen, and
    # the kernel reading the cached frames' K/V where they lie (StepCache.segments) rather than joined by a copy
    pad_keys = True
    attention_kernel_on = True
    kv_in_place = True

    def __init__(self, dit: DiT, dtype: torch.dtype, int8_engine: str = INT8_ENGINE,
                 static_scales: tuple | None = None, observe: bool = False):
        self.dtype = dtype
        self.int8_engine = int8_engine
        mixed = dtype == INT8 and int8_is_mixed(int8_engine)
        # Static int8: per block, per Euler step before the tail, the (scale, zero point) of the inputs
        # of qkv, attention-out, ff-in and ff-out (see cosyllama.flow.check.static_scales).
        self.static = dtype == INT8 and int8_is_static(int8_engine)
        if self.static and static_scales is None:
            raise ValueError(f"int8 engine {int8_engine!r} needs its calibrated static scales")
        self.scales = static_scales if self.static else None
        # observe: record those inputs' ranges per block and step (the calibration solve, on the dynamic
        # mixed path): self.ranges[block][step] = [[lo, hi] of qkv's, out's, ff-in's, ff-out's input]
        self.ranges: list[dict[int, list[list[float]]]] | None = (
            [{} for _ in dit.transformer_blocks] if observe else None)
        # dtype of the activations between the products: float32 on the int8 path, bf16 on the mixed one
        self.act_dtype = torch.bfloat16 if mixed else torch.float32 if dtype == INT8 else dtype
        if self.static:
            def lin(w, b, gelu=False):
                return _StaticInt8Linear(w, b, gelu)
        elif dtype == INT8:
            def lin(w, b, gelu=False):
                return _Int8Linear(w, b, gelu, int8_engine, self.act_dtype)
        else:
            def lin(w, b, gelu=False):
                return _LowpLinear(w, b, dtype, gelu)
        self.dit = dit  # time MLP, conv position embedding, final modulation/projection (float32)
        # the conv position embedding in the activations' dtype where that is bfloat16 (see _LowpConvPos)
        self.conv_pos = (_LowpConvPos(dit.input_embed.conv_pos_embed, torch.bfloat16)
                         if self.act_dtype == torch.bfloat16 and self.lowp_conv_pos
                         else dit.input_embed.conv_pos_embed)
        self._mod_memo: dict = {}  # schedule -> _modulations' result
        blk0 = dit.transformer_blocks[0]
        self.heads = blk0.attn.heads
        self.dim = blk0.attn.to_q.in_features
        self.dim_head = self.dim // self.heads
        with torch.no_grad():
            w = dit.input_embed.proj.weight  # (dim, 320): columns x | cond | mu | spks
            mel = dit.input_embed.proj.in_features // 4
            self.mel = mel
            self.w_in_x = w[:, :mel].contiguous()
            self.w_in_rest = w[:, mel:].contiguous()
            self.b_in = dit.input_embed.proj.bias
            self.blocks = []
            for b in dit.transformer_blocks:
                a, ff = b.attn, b.ff.ff
                self.blocks.append(dict(
                    w_mod=b.attn_norm.linear.weight, b_mod=b.attn_norm.linear.bias,
                    qkv=lin(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]),
                            torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias])),
                    out=lin(a.to_out[0].weight, a.to_out[0].bias),
                    ff1=lin(ff[0][0].weight, ff[0][0].bias, gelu=True),
                    ff2=lin(ff[2].weight, ff[2].bias)))
            # int8: the float32 products of the last INT8_FP32_LAST_STEPS steps (bf16 on the mixed path)
            self.tail_steps = INT8_FP32_LAST_STEPS if dtype == INT8 else 0
            self.tail_blocks = [dict(
                qkv=_LowpLinear(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]),
                                torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias]), torch.bfloat16),
                out=_LowpLinear(a.to_out[0].weight, a.to_out[0].bias, torch.bfloat16),
                ff1=_LowpLinear(ff[0][0].weight, ff[0][0].bias, torch.bfloat16, gelu=True),
                ff2=_LowpLinear(ff[2].weight, ff[2].bias, torch.bfloat16))
                for a, ff in ((b.attn, b.ff.ff) for b in dit.transformer_blocks)] if mixed else [dict(
                qkv=_Fp32Linear([(a.to_q.weight, a.to_q.bias), (a.to_k.weight, a.to_k.bias),
                                 (a.to_v.weight, a.to_v.bias)]),
                out=_Fp32Linear([(a.to_out[0].weight, a.to_out[0].bias)]),
                ff1=_Fp32Linear([(ff[0][0].weight, ff[0][0].bias)], gelu=True),
                ff2=_Fp32Linear([(ff[2].weight, ff[2].bias)]))
                for a, ff in ((b.attn, b.ff.ff) for b in dit.transformer_blocks)] if self.tail_steps else []

    def static_scales(self, steps: int) -> tuple:
        """From an observing solver's ranges (``observe=True``, after its calibration solves): per block,
        per Euler step before the tail, the four (scale, zero point) pairs :class:`_StaticInt8Linear` takes."""
        if self.ranges is None:
            raise ValueError("static_scales needs an observing solver")
        n = static_steps(steps)
        if any(set(r) != set(range(n)) for r in self.ranges):
            raise ValueError(f"the calibration solve did not see every block at all {n} int8 steps")
        return tuple(tuple(tuple(static_scale(lo, hi) for lo, hi in r[s]) for s in range(n)) for r in self.ranges)

    def _modulations(self, ts: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Per block, per step: the six modulation vectors ``(dim,)`` with 1 added to both scales
        (LayerNorm's weights); and the final (scale + 1, shift).

        They depend only on the times, the same in every call of a model (its fixed schedule), so
        they are kept per schedule: computed once they save every later call 22 reads of a 24 MB
        matrix (40-65 ms of a streaming chunk's call on 2 cores). Same arithmetic, same bits."""
        key = (ts.device, ts.detach().cpu().numpy().tobytes())
        hit = self._mod_memo.get(key) if self.keep_modulations else None
        if hit is not None:
            return hit
        with torch.no_grad():
            c = F.silu(self.dit.time_embed(ts))  # (S, dim)
            per_block = []
            for b in self.blocks:
                sh_a, sc_a, g_a, sh_f, sc_f, g_f = F.linear(c, b["w_mod"], b["b_mod"]).chunk(6, dim=-1)
                per_block.append((sh_a, 1 + sc_a, g_a, sh_f, 1 + sc_f, g_f))
            norm = self.dit.norm_out.linear
            scale, shift = F.linear(c, norm.weight, norm.bias).chunk(2, dim=-1)
        out = per_block, (1 + scale, shift)
        if len(self._mod_memo) >= 4:  # a handful of schedules at most (one per step count in use)
            self._mod_memo.clear()
        self._mod_memo[key] = out
        return out

    @staticmethod
    def _rotate_head0_(qkv: torch.Tensor, heads: int, cis: torch.Tensor) -> None:
        """In place on ``qkv (B, N, 3*dim)``: RoPE on the first ``2*cis.shape[-1]`` channels of q and
        of k (head 0; the reference rotates the first channels of the full projection). A channel
        pair (a, b) is the complex number a + ib, and rotating it is a product with ``cis`` =
        cos + i sin ``(N, 1, r/2)`` complex64: one vectorized op on the strided view (float32), where
        the real-arithmetic form on these strided views (4 products, 2 sums, a stack and a copy)
        cost ~12 % of an int8 DiT step on an AVX2 CPU."""
        b, n, _ = qkv.shape
        r = 2 * cis.shape[-1]
        qk0 = qkv.view(b, n, 3, heads, -1)[:, :, :2, 0, :r]  # (B, N, 2, r) view
        if qkv.dtype == torch.float32:
            torch.view_as_complex(qk0.unflatten(-1, (r // 2, 2))).mul_(cis)
        else:  # no bfloat16 complex type: rotate a float32 copy
            c = torch.view_as_complex(qk0.float().unflatten(-1, (r // 2, 2)))
            qk0.copy_(torch.view_as_real(c * cis).flatten(-2))

    def solve_from(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                   grid: list[tuple[torch.Tensor, torch.Tensor]], cfg_rate: float, streaming: bool,
                   cache: "FlowStreamCache | None" = None, keep: int = 0,
                   kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """noise ``(1, mel, N)``; mu, cond ``(B, mel, N)``; spks ``(B, mel)``; grid = ``[(t, dt), ...]``.
        Returns x at t=1, ``(B, mel, N)`` float32: B equal-length requests, each row the maths of
        its own B = 1 solve (the CFG batch is ``[B conditional, B unconditional]`` rows). Except at
        int8, whose per-call activation scale spans all rows (see :class:`_Int8Linear`): callers
        solve int8 rows one at a time. With ``cache`` (streaming only, B = 1) only frames
        ``cache.frames..N-1`` are computed and returned, and the cache is extended to frames
        ``0..keep-1`` (see :class:`StepCache`), its K/V kept in ``kv_dtype`` (the caller's
        :meth:`CFM.kv_cache_dtype`, which also sizes the cache's bound)."""
        dit, dt_, res = self.dit, self.act_dtype, self.residual_dtype
        b, n = mu.shape[0], mu.shape[2]
        start = cache.frames if cache is not None else 0
        m = n - start  # frames computed here
        eps = LN_EPS
        dim = self.dim
        mods, (f_scale, f_shift) = self._modulations(torch.cat([t for t, _ in grid]))
        # Constant part of the input projection; rows B.. of the CFG batch (mu, spks, cond zeroed) are the bias.
        rest = torch.cat([cond[:, :, start:].transpose(1, 2), mu[:, :, start:].transpose(1, 2),
                          spks[:, None, :].expand(-1, m, -1)], dim=-1)
        const = torch.cat([F.linear(rest, self.w_in_rest, self.b_in), self.b_in.expand(b, m, -1)])
        const = const.unflatten(0, (2, b))  # (CFG branch, request, m, dim)
        ang = dit.rotary_embed(n)[start:, ::2]  # (m, r/2): one angle per interleaved pair
        cis = torch.polar(torch.ones_like(ang), ang)[:, None, :]  # cos + i sin, broadcast over the q/k axis
        mask = chunk_attention_mask(n, dit.static_chunk_size, mu.device)[start:] if streaming else None
        # bf16 on the CPU: the attention kernel where chosen (native_attention: chunk mask as per-row key counts)
        kernel = (self.attention_kernel_on and dt_ == torch.bfloat16 and mu.device.type == "cpu"
                  and native_attention.choice(self.heads, self.dim_head).kernel)
        row_len = native_attention.chunk_row_lengths(n, start, dit.static_chunk_size) if kernel and streaming else None
        # keys padded to KEY_ALIGN frames under the mask (see KEY_ALIGN; CPU only: on CUDA a mask costs flash)
        pads = self.pad_keys and not kernel and mu.device.type == "cpu" and (mask is not None or dt_ == torch.bfloat16)
        key_pad = (-n) % KEY_ALIGN if pads else 0
        if key_pad:
            visible = torch.ones(m, n, dtype=torch.bool, device=mu.device) if mask is None else mask
            mask = F.pad(visible, (0, key_pad), value=False)
        if mask is not None:  # additive, once per call: what SDPA makes of a boolean mask on every call
            mask = torch.zeros(mask.shape, dtype=dt_, device=mu.device).masked_fill_(~mask, float("-inf"))
        x = noise[:, :, start:]
        heads = lambda t: t.unflatten(-1, (self.heads, self.dim_head)).transpose(1, 2)  # noqa: E731  (B, H, m, D)
        for s, (_, dt) in enumerate(grid):
            past = None if cache is None else StepCache(cache, s, keep, streaming, kv_dtype)
            # x is the same in both CFG branches: its projection is added to each.
            h = (const + F.linear(x.transpose(1, 2), self.w_in_x)).flatten(0, 1)  # (2B, m, dim) float32
            cpe = self.conv_pos
            h = (cpe(h) if past is None else past.conv_pos(cpe, h)) + h
            # a fresh tensor, updated in place below; row-major: the position convs leave the sum
            # channel-major, and every residual update and LayerNorm then ran on strided memory
            h = h.to(res).contiguous()  # (.to alone keeps the layout, and returns h itself at float32)
            tail = s >= len(grid) - self.tail_steps
            blocks = self.tail_blocks if tail else self.blocks
            for i, (blk, (sh_a, sc_a, g_a, sh_f, sc_f, g_f)) in enumerate(zip(blocks, mods)):
                q8 = self.scales[i][s] if self.static and not tail else None  # static: the 4 inputs' scales
                seen = self.ranges[i].setdefault(s, [[0.0, 0.0] for _ in range(4)]) \
                    if self.ranges is not None and not tail else None
                # LayerNorm on the residual rounded to the compute dtype, modulation as its affine
                # parameters: one cheap pass; its statistics are accumulated in float32 by layer_norm.
                # (Static int8: in float32, which the quantization pass reads.)
                ln_dt = torch.float32 if q8 else dt_
                n1 = F.layer_norm(h.to(ln_dt), (dim,), sc_a[s].to(ln_dt), sh_a[s].to(ln_dt), eps)
                if q8:
                    qkv = blk["qkv"](quantize_u8(n1, *q8[0]), q8[0], dt_)
                else:
                    _observe(seen, 0, n1)
                    qkv = blk["qkv"](n1)
                del n1
                self._rotate_head0_(qkv, self.heads, cis)
                q, k, v = qkv[..., :dim], qkv[..., dim:2 * dim], qkv[..., 2 * dim:]  # (B, m, dim) views
                before = None  # the kernel reads the cached frames' K/V where they lie, in front of the new ones'
                if past is not None and kernel and self.kv_in_place and past.store_dtype == k.dtype:
                    before, k, v = past.segments(i, k, v)
                elif past is not None:
                    k, v = past.kv(i, k, v, key_pad)  # (B, N + key_pad, dim): cached frames first
                elif key_pad:
                    k, v = joined(None, k, key_pad), joined(None, v, key_pad)
                q, k, v = heads(q), heads(k), heads(v)
                before = None if before is None else (heads(before[0]), heads(before[1]))
                o = native_attention.attend(q, k, v, mask, row_len, kernel, before)  # (B, H, m, D), m-major
                del q, k, v, qkv, before
                if q8:  # quantized straight from the m-major view (the result is row-major)
                    o = blk["out"](quantize_u8(o.transpose(1, 2), *q8[1]).flatten(2), q8[1], res)
                else:
                    o = o.transpose(1, 2).flatten(2)
                    _observe(seen, 1, o)
                    o = blk["out"](o)
                # Same-dtype in-place update: a mixed-dtype addcmul takes a slow unvectorized path.
                h.addcmul_(o.to(res), g_a[s].to(res))
                n2 = F.layer_norm(h.to(ln_dt), (dim,), sc_f[s].to(ln_dt), sh_f[s].to(ln_dt), eps)
                if q8:  # ff-in's epilogue: bias, GELU and ff-out's input scale; the hidden rows stay uint8
                    hid = blk["ff1"](quantize_u8(n2, *q8[2]), q8[2], torch.uint8, q8[3])
                    y = blk["ff2"](hid, q8[3], res)
                else:
                    _observe(seen, 2, n2)
                    hid = blk["ff1"](n2)
                    _observe(seen, 3, hid)
                    y = blk["ff2"](hid)
                del n2, hid
                h.addcmul_(y.to(res), g_f[s].to(res))
            h = F.layer_norm(h.float(), (dim,), f_scale[s], f_shift[s], eps)
            v = F.linear(h, dit.proj_out.weight, dit.proj_out.bias).transpose(1, 2)  # (2B, mel, m)
            x = x + dt * ((1.0 + cfg_rate) * v[:b] - cfg_rate * v[b:])
        return x.float()
