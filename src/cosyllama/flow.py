"""Flow stage: speech tokens -> 80-band log-mel (spec §7).

Pipeline of one call: token embedding -> pre-lookahead conv (3-token right context) -> repeat by
``token_mel_ratio`` -> conditional flow matching: 10 Euler steps of a DiT with classifier-free
guidance, started from a fixed noise buffer. Module attribute names equal the keys of ``flow.pt``
so the checkpoint loads strictly.

Streaming (spec §7.5): every call covers prompt + all tokens so far. The caller chooses
``streaming`` (50-frame block-causal DiT attention) and ``finalize`` (whether the last 3 tokens are
real content or only look-ahead), and slices off what it already emitted. The reference recomputes
everything on every call; a per-request :class:`FlowStreamCache` passed to :meth:`Flow.inference`
lets a streaming, non-final call compute only the frames after the blocks an earlier call of the
same request already finished (same result; see the class).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import FlowConfig, load_config
from .device import on_true_fp32, resolve_device
from .errors import InputError
from .precision import resolve_precision

NOISE_SEED = 0  # upstream seeds the global RNG with 0 right before drawing the ODE start noise
NOISE_FRAMES = 15_000  # mel frames in the fixed noise buffer (300 s at 50 frames/s, prompt included)
TIME_EMBED_DIM = 256  # sinusoidal time features fed to the DiT's time MLP
TIME_SCALE = 1000.0  # t in [0, 1] is scaled before the sinusoid
ROPE_BASE = 10_000.0
CONV_POS_KERNEL = 31
CONV_POS_GROUPS = 16
LN_EPS = 1e-6
CONV_CONTEXT = 2 * (CONV_POS_KERNEL - 1)  # input frames back that one conv position embedding frame reads
LOOKAHEAD_SLOPE = 0.01  # F.leaky_relu default slope, as upstream uses in the pre-lookahead layer


def flow_noise(n_mels: int = 80, frames: int = NOISE_FRAMES) -> torch.Tensor:
    """The fixed ODE start noise ``(1, n_mels, frames)`` float32, bit-equal to upstream's
    ``torch.manual_seed(0); torch.randn(1, 80, 15000)``. Drawn on a private CPU generator so the
    global RNG is left alone."""
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, n_mels, frames, generator=gen)


def cosine_t_span(n_steps: int) -> torch.Tensor:
    """Euler time grid ``1 - cos(linspace(0, 1, n+1) * pi/2)``, float32 ``(n+1,)``."""
    lin = torch.linspace(0, 1, n_steps + 1, dtype=torch.float32)
    return 1 - torch.cos(lin * 0.5 * torch.pi)


def chunk_attention_mask(n: int, chunk: int, device=None) -> torch.Tensor:
    """Block-causal boolean mask ``(n, n)`` (row = query): query i sees key j iff
    ``j < (i // chunk + 1) * chunk`` — its own ``chunk``-frame block and all earlier ones."""
    pos = torch.arange(n, device=device)
    limit = (pos // chunk + 1) * chunk
    return pos[None, :] < limit[:, None]


# ----------------------------------------------------------------------------------------------
# Pre-lookahead layer


class PreLookaheadLayer(nn.Module):
    """Residual conv pair over token embeddings: a k=(L+1) conv reading L tokens ahead, then a
    causal k=3 conv. Input/output ``(B, T, C)``; ``context`` holds the L look-ahead rows
    ``(B, L, C)`` or is None for zeros (end of utterance)."""

    def __init__(self, channels_in: int, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels_in, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels_in, 3)

    def forward(self, body: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        x = body.transpose(1, 2)
        if context is None:
            x = F.pad(x, (0, self.lookahead))
        else:
            assert context.shape[1] == self.lookahead
            x = torch.cat([x, context.transpose(1, 2)], dim=2)
        x = F.leaky_relu(self.conv1(x), LOOKAHEAD_SLOPE)
        x = self.conv2(F.pad(x, (self.conv2.kernel_size[0] - 1, 0)))
        return x.transpose(1, 2) + body


# ----------------------------------------------------------------------------------------------
# DiT


class TimeEmbedding(nn.Module):
    """t ``(B,)`` in [0, 1] -> conditioning vector ``(B, dim)``."""

    def __init__(self, dim: int):
        super().__init__()
        half = TIME_EMBED_DIM // 2
        # Upstream divides by (half - 1), so the last frequency is exactly 1/10000.
        freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
        self.register_buffer("freqs", freqs, persistent=False)
        self.time_mlp = nn.Sequential(nn.Linear(TIME_EMBED_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        e = TIME_SCALE * t[:, None] * self.freqs[None, :]
        return self.time_mlp(torch.cat([e.sin(), e.cos()], dim=-1))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped k=31 convs with left zero padding, each followed by Mish: ``(B, N, D)`` -> same."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.transpose(1, 2)
        y = self.conv1(F.pad(y, (CONV_POS_KERNEL - 1, 0)))
        y = self.conv2(F.pad(y, (CONV_POS_KERNEL - 1, 0)))
        return y.transpose(1, 2)


class InputEmbedding(nn.Module):
    """Project ``[x, cond, mu, spks]`` (this order; each ``(B, N, 80)``) to ``(B, N, dim)`` and add the
    causal conv position embedding."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim)

    def forward(self, x, cond, mu, spks, past: "_StepCache | None" = None):
        h = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        return (self.conv_pos_embed(h) if past is None else past.conv_pos(self.conv_pos_embed, h)) + h


class RotaryTable(nn.Module):
    """Rotary angles for positions 0..N-1; ``inv_freq`` is stored in ``flow.pt``."""

    def __init__(self, dim_head: int):
        super().__init__()
        inv = 1.0 / (ROPE_BASE ** (torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head))
        self.register_buffer("inv_freq", inv)

    def forward(self, n: int) -> torch.Tensor:
        """``(N, dim_head)`` angles, each repeated for an interleaved channel pair (f0, f0, f1, f1, ...)."""
        pos = torch.arange(n, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        ang = pos[:, None] * self.inv_freq[None, :]
        return ang.repeat_interleave(2, dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``angles.shape[-1]`` channels of ``x (B, N, C)`` in interleaved pairs
    (a, b) -> (a cos - b sin, b cos + a sin); the remaining channels pass unchanged. Applied to the
    full projection before the head split, so only head 0 gets positions (upstream behaviour)."""
    r = angles.shape[-1]
    head, tail = x[..., :r], x[..., r:]
    pairs = head.unflatten(-1, (r // 2, 2))
    swapped = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    head = head * angles.cos() + swapped * angles.sin()
    return torch.cat([head, tail], dim=-1)


class AdaLNZero(nn.Module):
    """Six modulation vectors from the time embedding: shift/scale/gate for attention, then for FF."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(c)).chunk(6, dim=-1)


class AdaLNFinal(nn.Module):
    """Final modulation: chunks are (scale, shift) — scale first, unlike the blocks."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(c)).chunk(2, dim=-1)
        return F.layer_norm(h, h.shape[-1:], eps=LN_EPS) * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # index 1 was a Dropout upstream

    def forward(self, x: torch.Tensor, angles: torch.Tensor, mask: torch.Tensor | None, kv=None) -> torch.Tensor:
        """x ``(B, N, dim)``; mask ``(N, N)`` bool (True = may attend) or None for full attention.
        Streaming cache: ``kv(k, v)`` returns K and V with earlier frames' in front (then x, angles
        and the mask rows cover only the new frames)."""
        q = apply_rotary(self.to_q(x), angles)
        k = apply_rotary(self.to_k(x), angles)
        v = self.to_v(x)
        if kv is not None:
            k, v = kv(k, v)
        b, n, _ = q.shape
        q = q.view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # Upstream then zeroes positions its mask's last query row excludes: never any, with these masks.
        return self.to_out[0](o.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = dim * mult
        # Index layout mirrors the checkpoint keys ff.ff.0.0 / ff.ff.2 (index 1 was a Dropout).
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(inner, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int):
        super().__init__()
        self.attn_norm = AdaLNZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff = FeedForward(dim, ff_mult)

    def forward(self, h, c, angles, mask, kv=None):
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = self.attn_norm(c)
        n1 = F.layer_norm(h, h.shape[-1:], eps=LN_EPS) * (1 + scale_a[:, None]) + shift_a[:, None]
        h = h + gate_a[:, None] * self.attn(n1, angles, mask, kv)
        n2 = F.layer_norm(h, h.shape[-1:], eps=LN_EPS) * (1 + scale_f[:, None]) + shift_f[:, None]
        return h + gate_f[:, None] * self.ff(n2)


class DiT(nn.Module):
    """Velocity estimator. All tensors channels-first like upstream: x, mu, cond ``(B, 80, N)``,
    spks ``(B, 80)``, t ``(B,)``; returns ``(B, 80, N)``.

    With ``past`` (a :class:`_StepCache`, streaming only) x, mu, cond hold only frames
    ``past.start..N-1`` and so does the result: the same operations on fewer rows, the earlier
    frames' K/V and conv input coming from the cache."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        dim = cfg.dit_dim
        self.static_chunk_size = cfg.static_chunk_size
        self.time_embed = TimeEmbedding(dim)
        self.input_embed = InputEmbedding(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, dim)
        self.rotary_embed = RotaryTable(cfg.dit_dim_head)
        self.transformer_blocks = nn.ModuleList(
            DiTBlock(dim, cfg.dit_heads, cfg.dit_dim_head, cfg.dit_ff_mult) for _ in range(cfg.dit_depth))
        self.norm_out = AdaLNFinal(dim)
        self.proj_out = nn.Linear(dim, cfg.out_channels)

    def forward(self, x, mu, t, spks, cond, streaming: bool = False,
                past: "_StepCache | None" = None) -> torch.Tensor:
        m = x.shape[2]
        start = 0 if past is None else past.start
        n = start + m
        c = self.time_embed(t)
        spks = spks[:, None, :].expand(-1, m, -1)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, past)
        angles = self.rotary_embed(n)[start:]
        # Full attention needs no mask (an all-True mask is the same computation, slower on GPU).
        mask = chunk_attention_mask(n, self.static_chunk_size, x.device)[start:] if streaming else None
        for i, block in enumerate(self.transformer_blocks):
            h = block(h, c, angles, mask, None if past is None else functools.partial(past.kv, i))
        return self.proj_out(self.norm_out(h, c)).transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# Mixed-precision solver (precision "bf16")


def _onednn_linear_available(dtype: torch.dtype) -> bool:
    """oneDNN's fused linear (pre-packed weights, bias and GELU in the kernel) is usable on this CPU."""
    try:
        ops = torch.ops.mkldnn
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                and hasattr(ops, "_reorder_linear_weight")
                and (dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())))
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


class FastDiT:
    """The whole Euler/CFG solve with the DiT's matrix products in a low-precision ``dtype``.

    Same maths as :class:`CFM` + :class:`DiT`, re-arranged so that nothing is computed twice:

    * the time embedding and every block's AdaLN modulation depend only on t, which is the same for
      both CFG rows and fixed in advance, so all of them are computed once per call, for all steps,
      in float32 (one matrix product per block instead of one per block per step);
    * the input projection is linear, so its ``[cond, mu, spks]`` part (constant over the steps) is
      computed once; only the ``x`` part (the same for both CFG rows) is recomputed per step;
    * the rotary angles, their sin/cos and the attention mask are computed once;
    * q, k and v come from one fused matrix product; RoPE rotates only the 64 channels of head 0,
      in place; SDPA reads q/k/v as strided views (no head-split copies);
    * LayerNorm and its modulation are one ``layer_norm`` call with the (shared) scale/shift as its
      affine parameters.

    Precision: the weights of q/k/v, out, and the feed-forward are held in ``dtype``; LayerNorm
    statistics, the residual stream, the modulation, the input/output projections, the conv
    position embedding, the CFG combination and the Euler update stay float32. Noise in and mel out
    are float32. Not a module: a read-only view built from a loaded :class:`DiT`.

    Streaming cache: :meth:`solve_from` resumes from a :class:`FlowStreamCache` the way the
    reference DiT does (see :class:`_StepCache`).
    """

    def __init__(self, dit: DiT, dtype: torch.dtype, residual_dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.residual_dtype = residual_dtype  # float32; bfloat16 only for measuring what it costs
        self.dit = dit  # time MLP, conv position embedding, final modulation/projection (float32)
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
                    qkv=_LowpLinear(torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]),
                                    torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias]), dtype),
                    out=_LowpLinear(a.to_out[0].weight, a.to_out[0].bias, dtype),
                    ff1=_LowpLinear(ff[0][0].weight, ff[0][0].bias, dtype, gelu=True),
                    ff2=_LowpLinear(ff[2].weight, ff[2].bias, dtype)))

    def _modulations(self, ts: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Per block, per step: the six modulation vectors ``(dim,)``; and the final (scale, shift)."""
        c = F.silu(self.dit.time_embed(ts))  # (S, dim)
        per_block = [F.linear(c, b["w_mod"], b["b_mod"]).chunk(6, dim=-1) for b in self.blocks]
        final = F.linear(c, self.dit.norm_out.linear.weight, self.dit.norm_out.linear.bias).chunk(2, dim=-1)
        return per_block, final

    @staticmethod
    def _rotate_head0_(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place on ``qkv (B, N, 3*dim)``: RoPE on the first ``2*cos.shape[-1]`` channels of q and
        of k (head 0; the reference rotates the first channels of the full projection)."""
        b, n, _ = qkv.shape
        r = 2 * cos.shape[-1]
        qk0 = qkv.view(b, n, 3, heads, -1)[:, :, :2, 0, :r]  # (B, N, 2, r) view
        pairs = qk0.float().unflatten(-1, (r // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rot = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
        qk0.copy_(rot)

    def solve(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              grid: list[tuple[torch.Tensor, torch.Tensor]], cfg_rate: float, streaming: bool) -> torch.Tensor:
        """noise, mu, cond ``(1, mel, N)``; spks ``(1, mel)``; grid = ``[(t, dt), ...]``.
        Returns x at t=1, ``(1, mel, N)`` float32."""
        return self.solve_from(noise, mu, spks, cond, grid, cfg_rate, streaming)

    def solve_from(self, noise: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                   grid: list[tuple[torch.Tensor, torch.Tensor]], cfg_rate: float, streaming: bool,
                   cache: "FlowStreamCache | None" = None, keep: int = 0) -> torch.Tensor:
        """:meth:`solve`; with ``cache`` (streaming only) only frames ``cache.frames..N-1`` are
        computed and returned, and the cache is extended to frames ``0..keep-1`` (see
        :class:`_StepCache`)."""
        dit, dt_, res = self.dit, self.dtype, self.residual_dtype
        n = mu.shape[2]
        start = cache.frames if cache is not None else 0
        m = n - start  # frames computed here
        eps = LN_EPS
        dim = self.dim
        mods, (f_scale, f_shift) = self._modulations(torch.cat([t for t, _ in grid]))
        # Constant part of the input projection; row 1 of the CFG batch (mu, spks, cond zeroed) is the bias.
        rest = torch.cat([cond[:, :, start:].transpose(1, 2), mu[:, :, start:].transpose(1, 2),
                          spks[:, None, :].expand(-1, m, -1)], dim=-1)
        const = torch.cat([F.linear(rest, self.w_in_rest, self.b_in), self.b_in.expand(1, m, -1)])
        ang = dit.rotary_embed(n)[start:, ::2]  # (m, r/2): one angle per interleaved pair
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # broadcast over the q/k axis
        mask = chunk_attention_mask(n, dit.static_chunk_size, mu.device)[start:] if streaming else None
        ones = torch.ones(dim, device=mu.device)
        x = noise[:, :, start:]
        for s, (_, dt) in enumerate(grid):
            past = None if cache is None else _StepCache(cache, s, keep, streaming)
            h = const + F.linear(x.transpose(1, 2), self.w_in_x)  # (2, m, dim) float32
            cpe = dit.input_embed.conv_pos_embed
            h = (cpe(h) if past is None else past.conv_pos(cpe, h)) + h
            h = h.to(res)  # a fresh tensor: updated in place below
            for i, (blk, (sh_a, sc_a, g_a, sh_f, sc_f, g_f)) in enumerate(zip(self.blocks, mods)):
                # LayerNorm on the residual rounded to the compute dtype, modulation as its affine
                # parameters: one cheap pass; its statistics are accumulated in float32 by layer_norm.
                n1 = F.layer_norm(h.to(dt_), (dim,), (ones + sc_a[s]).to(dt_), sh_a[s].to(dt_), eps)
                qkv = blk["qkv"](n1)
                self._rotate_head0_(qkv, self.heads, cos, sin)
                q, k, v = qkv[..., :dim], qkv[..., dim:2 * dim], qkv[..., 2 * dim:]  # (B, m, dim) views
                if past is not None:
                    k, v = past.kv(i, k, v)  # (B, N, dim): cached frames first
                q, k, v = (t.unflatten(-1, (self.heads, self.dim_head)).transpose(1, 2) for t in (q, k, v))
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, m, D), m-major
                del q, k, v, qkv
                o = blk["out"](o.transpose(1, 2).flatten(2))
                # Same-dtype in-place update: a mixed-dtype addcmul takes a slow unvectorized path.
                h.addcmul_(o.to(res), g_a[s].to(res))
                n2 = F.layer_norm(h.to(dt_), (dim,), (ones + sc_f[s]).to(dt_), sh_f[s].to(dt_), eps)
                h.addcmul_(blk["ff2"](blk["ff1"](n2)).to(res), g_f[s].to(res))
            h = F.layer_norm(h.float(), (dim,), ones + f_scale[s], f_shift[s], eps)
            v = F.linear(h, dit.proj_out.weight, dit.proj_out.bias).transpose(1, 2)  # (2, mel, m)
            x = x + dt * ((1.0 + cfg_rate) * v[0:1] - cfg_rate * v[1:2])
        return x.float()


# ----------------------------------------------------------------------------------------------
# Per-request streaming cache

DEFAULT_STREAM_CACHE_MB = 2048.0  # per request; ~1100 frames (22 s, prompt included) at full size, bf16


class FlowStreamCache:
    """What one streaming request's flow calls can reuse from its earlier calls.

    Why it is valid: in a streaming, non-final call (block-causal attention over
    ``static_chunk_size``-frame blocks, the real next 3 tokens as look-ahead) a frame depends only
    on frames of its own and earlier blocks: the mask hides later blocks, the two position convs
    are causal, the pre-lookahead layer reads the actual next tokens, and the ODE starts from the
    same fixed noise prefix. So frames of blocks an earlier call of the request completed have,
    at every Euler step and block and in both CFG rows, the same hidden states in every later call
    that extends its tokens. Such a call computes only its new frames, attending to the cached K
    (after RoPE) and V of the earlier ones; the result equals recomputing from scratch up to float
    rounding: the reference itself does not reproduce earlier blocks bit for bit from call to call
    (their attention runs over more, masked, keys, which rounds differently), so cached frames
    differ from recomputed ones by ~1e-6 at fp32 (observed <= 3e-6 on mels of magnitude ~10), and
    at bf16 by its own rounding (~2e-3). A call with nothing to reuse runs the same operations as
    the uncached path.

    Held (per Euler step): for each DiT block K and V of the cached frames for both CFG rows,
    each ``(2, frames, inner)`` in the solver's dtype; the last ``CONV_CONTEXT`` (60) input-projection
    frames ``(2, 60, dim)`` float32 (what the position convs of the next frames read back); plus the
    finished mel of the cached frames and the prompt/token ids they came from. K/V dominate:
    ``steps x blocks x 2 rows x 2 x inner`` values per frame = 1.8 MB per frame at full size in
    bf16 (10 x 22 x 2 x 2 x 1024 x 2 bytes), 3.6 MB in fp32; ~5 MB fixed for the conv context.

    Bound: the K/V kept never exceed ``max_mb`` megabytes (MiB; default
    ``DEFAULT_STREAM_CACHE_MB`` = 2048, i.e. ~1100 frames = 22 s of prompt + speech in bf16, half
    that in fp32) nor ``max_frames`` frames if given. Past the bound the cache keeps its prefix and
    later calls recompute the frames after it every time (slower, same result); a bound below one
    block (e.g. ``max_mb=0``) disables caching. The count is rounded down to whole blocks.

    Validity: every call checks that the cache belongs to it — same module and weights (any
    ``load_state_dict`` / ``.to()`` / ``set_precision`` invalidates), compute dtype, steps, prompt
    mel and speaker embedding, and prompt + token ids that start with the ids of the call that
    filled it (its look-ahead tokens included); otherwise the cache is dropped and the call
    recomputes from scratch (``rebuilds`` counts it). Only streaming, non-final calls use it; any
    other call leaves it alone. The frames kept are whole blocks, so a later call never resumes
    inside a block.

    One object per request, never shared between requests or threads; :meth:`clear` frees it.
    Counters for tests and benchmarks: ``calls``, ``reused_frames``, ``computed_frames``,
    ``rebuilds``, ``last_start`` (frames taken from the cache by the last call).
    """

    def __init__(self, max_mb: float = DEFAULT_STREAM_CACHE_MB, max_frames: int | None = None):
        if not max_mb >= 0 or (max_frames is not None and max_frames < 0):
            raise InputError(f"stream cache bounds must be >= 0, got max_mb={max_mb!r}, max_frames={max_frames!r}")
        self.max_mb = float(max_mb)
        self.max_frames = max_frames
        self.mark = 0  # also keep the conv context at this frame (for :meth:`prefix`); 0: don't
        self.calls = self.reused_frames = self.computed_frames = self.rebuilds = self.last_start = 0
        self.clear()

    def clear(self) -> None:
        """Free everything cached (the counters stay)."""
        self.frames = 0  # cached frames, a whole number of attention blocks
        # (step, block) -> K (after RoPE), V of the cached frames, each (2, frames, inner)
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}  # step -> input-projection frames before `frames` (2, <=60, dim)
        self.conv_mark: dict[int, torch.Tensor] = {}  # step -> the same before `mark`, when asked for
        self.mel: torch.Tensor | None = None  # (1, mel, frames) float32: x at t=1
        self._key: tuple = ()  # what besides the ids the frames depend on
        self._ids: torch.Tensor | None = None  # (1, P+T) prompt + token ids of the call that filled it

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        ts = [t for kv in self.kv.values() for t in kv] + list(self.conv.values()) + list(self.conv_mark.values())
        ts += [self.mel] if self.mel is not None else []
        return sum(t.numel() * t.element_size() for t in ts)

    def limit_frames(self, bytes_per_frame: int, chunk: int) -> int:
        """Most frames this cache may hold at ``bytes_per_frame`` (K/V bytes), a multiple of ``chunk``."""
        frames = int(self.max_mb * 2**20 // bytes_per_frame)
        if self.max_frames is not None:
            frames = min(frames, self.max_frames)
        return frames // chunk * chunk

    def start(self, key: tuple, ids: torch.Tensor, n: int, chunk: int) -> int:
        """Frames a call of ``n`` frames with this ``key`` and these ``ids`` may take from the
        cache; drops the cache (counted in ``rebuilds``) when it does not belong to the call."""
        if self.frames == 0:
            self.clear()
            return 0
        old = self._ids
        ok = (len(key) == len(self._key) and all(_same(a, b) for a, b in zip(key, self._key))
              and old is not None and ids.shape[1] >= old.shape[1] and torch.equal(ids[:, :old.shape[1]], old)
              and self.frames % chunk == 0 and self.frames <= n)
        if not ok:
            self.clear()
            self.rebuilds += 1
            return 0
        return self.frames

    def commit(self, key: tuple, ids: torch.Tensor, keep: int, mel: torch.Tensor) -> None:
        """After a solve that stored frames ``0..keep-1``: remember them and what they belong to."""
        self.frames = keep
        self.mel = mel[:, :, :keep].clone()
        self._key = tuple(k.clone() if isinstance(k, torch.Tensor) else k for k in key)
        self._ids = ids.clone()

    # Sharing frames between requests. Entries are only ever replaced, never written in place
    # (``_StepCache`` assigns new tensors, ``commit``/``clear`` new objects), so caches may share
    # tensors: a copy costs two small dicts, and a later call of either cache leaves the other intact.

    def prefix(self, n_ids: int, frames: int | None = None) -> FlowStreamCache | None:
        """A cache holding this one's first ``frames`` frames (default: all), valid for any call whose
        ids start with this one's first ``n_ids`` — the caller vouches that those frames depend on
        no later id. ``frames`` short of all needs the conv context a solve kept at ``mark ==
        frames``. None when there is nothing to give. Shares the tensors where it can."""
        frames = self.frames if frames is None else frames
        if frames <= 0 or frames > self.frames or self._ids is None or n_ids > self._ids.shape[1]:
            return None
        out = FlowStreamCache(self.max_mb, self.max_frames)
        if frames == self.frames:
            out.kv, out.conv, out.mel = dict(self.kv), dict(self.conv), self.mel
        else:
            if self.mark != frames or set(self.conv_mark) != set(self.conv):
                return None
            out.kv = {slot: (k[:, :frames].clone(), v[:, :frames].clone()) for slot, (k, v) in self.kv.items()}
            out.conv, out.mel = dict(self.conv_mark), self.mel[:, :, :frames].clone()
        out.frames, out._key, out._ids = frames, self._key, self._ids[:, :n_ids]
        return out

    def load(self, other: FlowStreamCache) -> None:
        """Take ``other``'s frames (shared, see :meth:`prefix`) in place of this cache's own; the
        next call still checks that they belong to it."""
        self.clear()
        self.frames, self.kv, self.conv, self.mel = other.frames, dict(other.kv), dict(other.conv), other.mel
        self._key, self._ids = other._key, other._ids


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
    return a is b or a == b


class _StepCache:
    """One Euler step of a solve that resumes from ``cache`` at frame ``start = cache.frames`` (a
    whole number of attention blocks) and leaves the cache holding frames ``0..keep-1``. Both
    solvers (reference DiT and :class:`FastDiT`) call it at the same two places:

    * :meth:`conv_pos` — the causal conv position embedding of the new frames. A frame reads
      ``CONV_CONTEXT`` (60) input-projection frames back (two k=31 convs), so the cache keeps the
      last 60 before ``start``; with them the unpadded convs give exactly the new frames (with all
      frames from 0, the module's own zero padding does).
    * :meth:`kv` — per block, the new frames' K (after RoPE) and V with the cached frames' put
      in front: ``(B, N, inner)``, what the new queries attend to.

    Entries are replaced one by one as the solve goes (old and new caches never both exist whole),
    so the caller must :meth:`FlowStreamCache.commit` afterwards, or clear the cache if it fails."""

    def __init__(self, cache: FlowStreamCache, step: int, keep: int, streaming: bool):
        if not streaming:
            raise ValueError("the streaming cache needs the block-causal (streaming) mask")
        self.cache, self.step, self.keep = cache, step, keep
        self.start = cache.frames
        self.store = keep > self.start

    def conv_pos(self, cpe: CausalConvPositionEmbedding, h: torch.Tensor) -> torch.Tensor:
        """``h (B, m, dim)``: input projection of frames ``start..N-1`` -> their position embedding."""
        start, keep = self.start, self.keep
        if start == 0:
            hx, first, y = h, 0, cpe(h)  # hx holds frames first..N-1
        else:
            ctx = self.cache.conv[self.step]
            hx, first = torch.cat([ctx, h], dim=1), start - ctx.shape[1]
            if first == 0:
                y = cpe(hx)[:, start:]
            else:
                y = cpe.conv2(cpe.conv1(hx.transpose(1, 2))).transpose(1, 2)
        if self.store:
            self.cache.conv[self.step] = hx[:, max(keep - CONV_CONTEXT, 0) - first:keep - first].clone()
            mark = self.cache.mark
            if 0 < mark <= keep and first <= max(mark - CONV_CONTEXT, 0):
                self.cache.conv_mark[self.step] = hx[:, max(mark - CONV_CONTEXT, 0) - first:mark - first].clone()
        return y

    def kv(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated), V ``(B, m, inner)`` of the new frames -> those of all N frames."""
        slot = (self.step, block)
        if self.start:
            k0, v0 = self.cache.kv[slot]
            k, v = torch.cat([k0, k], dim=1), torch.cat([v0, v], dim=1)
        if self.store:  # a copy unless k/v already are exactly the frames kept
            self.cache.kv[slot] = (k[:, :self.keep].contiguous(), v[:, :self.keep].contiguous())
        return k, v


# ----------------------------------------------------------------------------------------------
# Conditional flow matching sampler


class CFM(nn.Module):
    """Euler ODE solver with classifier-free guidance around :class:`DiT` (spec §7.3)."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        if cfg.t_scheduler != "cosine":
            raise InputError(f"flow t_scheduler {cfg.t_scheduler!r} is not supported; only 'cosine' is")
        self.n_timesteps = cfg.n_timesteps
        self.cfg_rate = cfg.inference_cfg_rate
        self.estimator = DiT(cfg)
        self.register_buffer("rand_noise", flow_noise(cfg.mel_dim), persistent=False)
        # float32: the reference solver below. bfloat16: the mixed-precision solver (FastDiT).
        self.compute_dtype = torch.float32
        self._fast: FastDiT | None = None  # weights re-laid-out for the fast solver, built on first use
        self._weights_version = 0  # bumped on every change below: streaming caches check it
        self.estimator.register_load_state_dict_post_hook(lambda *_: self.drop_fast_cache())

    def drop_fast_cache(self) -> None:
        """Forget the fast solver's weight copies (after weights, dtype or device change); streaming
        caches filled before no longer match and are rebuilt on their next call."""
        self._fast = None
        self._weights_version += 1

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda() / .float(): copies must follow
        self.drop_fast_cache()
        return super()._apply(fn, *args, **kwargs)

    def time_grid(self) -> list[torch.Tensor]:
        """The ``(t, dt)`` pairs of the Euler steps, each a float32 ``(1,)`` tensor, accumulated
        exactly as the reference solver does."""
        t_span = cosine_t_span(self.n_timesteps).to(self.rand_noise.device)
        t, dt = t_span[0:1], t_span[1] - t_span[0]
        out = []
        for step in range(1, len(t_span)):
            out.append((t, dt))
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return out

    def _check_length(self, n: int) -> None:
        if n > self.rand_noise.shape[2]:
            raise InputError(f"flow input of {n} mel frames (prompt included) exceeds the "
                             f"{self.rand_noise.shape[2]}-frame noise buffer (300 s)")

    def _fast_solver(self) -> FastDiT:
        if self._fast is None or self._fast.dtype != self.compute_dtype:
            self._fast = FastDiT(self.estimator, self.compute_dtype)
        return self._fast

    def kv_bytes_per_frame(self) -> int:
        """Bytes a streaming cache holds per mel frame: K and V of both CFG rows, every block and step."""
        blk = self.estimator.transformer_blocks
        inner = blk[0].attn.to_k.out_features if len(blk) else 0
        item = torch.empty(0, dtype=self.compute_dtype).element_size()
        return self.n_timesteps * len(blk) * 2 * 2 * inner * item

    def forward_cached(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                       cache: FlowStreamCache, key: tuple, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with ``streaming=True``, resuming from ``cache`` where it belongs to this
        call (``key``: what besides the ids the frames depend on; ``ids``: prompt + token ids) and
        leaving it filled with this call's complete blocks, within its bound. Same output."""
        n = mu.shape[2]
        self._check_length(n)
        chunk = self.estimator.static_chunk_size
        key = (self, self._weights_version, self.compute_dtype, self.n_timesteps, self.cfg_rate, chunk) + tuple(key)
        start = keep = 0
        if chunk > 0 and len(self.estimator.transformer_blocks):
            start = cache.start(key, ids, n, chunk)
            keep = max(start, min(n // chunk * chunk, cache.limit_frames(self.kv_bytes_per_frame(), chunk)))
        if keep == 0:  # nothing to reuse or keep (bound below one block): plain recomputation
            cache.clear()
            return self.forward(mu, spks, cond, streaming=True)
        cache.calls += 1
        cache.last_start = start
        cache.reused_frames += start
        cache.computed_frames += n - start
        if start == n:  # the same call again
            return cache.mel[:, :, :n].clone()
        try:
            x = self.forward(mu, spks, cond, streaming=True, cache=cache, keep=keep)
        except BaseException:
            cache.clear()  # possibly half replaced
            raise
        if start:
            x = torch.cat([cache.mel[:, :, :start], x], dim=2)
        cache.commit(key, ids, keep, x)
        return x

    def forward(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False,
                cache: FlowStreamCache | None = None, keep: int = 0) -> torch.Tensor:
        """mu, cond ``(1, 80, N)``, spks ``(1, 80)`` -> ODE state at t=1 ``(1, 80, N)`` float32.

        With ``cache`` (from :meth:`forward_cached`, which checks it belongs to these inputs): only
        frames ``cache.frames..N-1`` are computed and returned, and the cache is extended to frames
        ``0..keep-1`` (see :class:`_StepCache`)."""
        n = mu.shape[2]
        self._check_length(n)
        if self.compute_dtype != torch.float32:
            return self._fast_solver().solve_from(self.rand_noise[:, :, :n].float(), mu.float(), spks.float(),
                                                  cond.float(), self.time_grid(), self.cfg_rate, streaming,
                                                  cache, keep)
        start = 0 if cache is None else cache.frames
        x = self.rand_noise[:, :, start:n].to(mu.dtype)
        t_span = cosine_t_span(self.n_timesteps).to(mu.device)
        # Row 1 of the CFG batch is the unconditional branch: mu, spks and cond all zeroed.
        mu_in = torch.cat([mu, torch.zeros_like(mu)])[:, :, start:]
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])[:, :, start:]
        # t is accumulated (t += dt) and dt re-derived from it, as upstream does, so the times the
        # estimator sees carry the same float32 rounding.
        t = t_span[0:1]
        dt = t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            past = None if cache is None else _StepCache(cache, step - 1, keep, streaming)
            v = self.estimator(torch.cat([x, x]), mu_in, t.expand(2), spks_in, cond_in, streaming, past=past)
            v_cond, v_uncond = v[0:1], v[1:2]
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()


# ----------------------------------------------------------------------------------------------
# The whole flow stage


@dataclass(frozen=True)
class FlowInputs:
    """Decoder inputs built from tokens (for inspection and tests). mu, cond ``(1, 80, N)``,
    spks ``(1, 80)``; ``prompt_frames`` = mel frames of the prompt at the start of N."""

    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor
    prompt_frames: int


class Flow(nn.Module):
    """CosyVoice3 flow: ``inference(token, prompt_token, prompt_feat, embedding, ...)`` -> mel."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels,
                                                     cfg.pre_lookahead_len)
        self.decoder = CFM(cfg)

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", precision: str = "fp32",
                 n_timesteps: int | None = None) -> "Flow":
        """Build from ``cosyvoice3.yaml`` and load ``flow.pt`` strictly; float32 weights, eval mode.

        ``precision``: ``"fp32"`` (reference), ``"bf16"`` or ``"auto"`` (see :meth:`set_precision`).
        ``n_timesteps``: Euler steps (default: the config's 10); fewer trade quality for speed."""
        from .weights import load_flow_weights

        dev = resolve_device(device)
        cfg = load_config(model_dir)
        flow = cls(cfg.flow)
        flow.load_state_dict(load_flow_weights(Path(cfg.model_dir) / "flow.pt", cfg.flow), strict=True)
        flow = flow.to(dev).eval()
        flow.set_precision(precision)
        if n_timesteps is not None:
            flow.set_n_timesteps(n_timesteps)
        return flow

    @property
    def device(self) -> torch.device:
        return self.input_embedding.weight.device

    @property
    def precision(self) -> torch.dtype:
        """Compute dtype of the DiT: ``torch.float32`` (reference) or ``torch.bfloat16``."""
        return self.decoder.compute_dtype

    def set_precision(self, precision: str | torch.dtype | None) -> torch.dtype:
        """Choose the DiT compute precision: ``"fp32"`` — the reference float32 solver;
        ``"bf16"`` — bfloat16 matrix products with float32 LayerNorm statistics, residual stream and
        interfaces (:class:`FastDiT`); ``"auto"`` — bf16 where this device computes it natively
        (CPU with AVX512-BF16/AMX, CUDA with bf16 support), else fp32. Returns the dtype chosen;
        raises :class:`InputError` for an unknown name. The float32 weights stay (the fp32 path
        needs them); bf16 adds pre-packed copies of the block matrices (~370 MB at full size), made
        here. Call it before sharing the module between threads; ``inference`` is unchanged."""
        dtype = resolve_precision(precision, self.device)
        self.decoder.compute_dtype = dtype
        self.decoder.drop_fast_cache()
        if dtype != torch.float32:  # build the weight copies now, not inside the first (timed) request
            self.decoder._fast = FastDiT(self.decoder.estimator, dtype)
        return dtype

    def set_n_timesteps(self, n: int) -> None:
        """Euler steps of the solver (reference: 10). Fewer steps are faster and change the mel
        (measured in ``scripts/bench_flow_vocoder.py``); an explicit quality/speed trade only."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100:
            raise InputError(f"flow n_timesteps must be an integer from 1 to 100, got {n!r}")
        self.decoder.n_timesteps = n

    @on_true_fp32
    def prepare(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                embedding: torch.Tensor, finalize: bool = True) -> FlowInputs:
        """Everything before the ODE solver (spec §7.2 steps 1-5); see :meth:`inference`."""
        self._check_inputs(token, prompt_token, prompt_feat, embedding, finalize)
        dev = self.device
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(dev, torch.float32), dim=1))
        emb = self.input_embedding(self._ids(prompt_token, token))
        look = self.cfg.pre_lookahead_len
        if finalize:
            h = self.pre_lookahead_layer(emb)
        else:
            h = self.pre_lookahead_layer(emb[:, :-look], emb[:, -look:])
        mu = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2)
        prompt_frames = prompt_feat.shape[1]
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.to(dev, torch.float32).transpose(1, 2)
        return FlowInputs(mu=mu, cond=cond, spks=spks, prompt_frames=prompt_frames)

    @on_true_fp32
    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True,
                  cache: FlowStreamCache | None = None) -> torch.Tensor:
        """Synthesize the mel of ``token``, conditioned on a prompt.

        Args:
            token: ``(1, T)`` int speech tokens (25 Hz) to synthesize.
            prompt_token: ``(1, P)`` int prompt speech tokens (P may be 0).
            prompt_feat: ``(1, 2P, 80)`` float prompt log-mel (24 kHz, 50 frames/s).
            embedding: ``(1, 192)`` float raw speaker embedding (L2-normalised here).
            streaming: block-causal DiT attention (``static_chunk_size``-frame blocks) instead of full.
            finalize: True when ``token`` ends the utterance (3 zero frames of look-ahead); False when
                its last 3 tokens are only look-ahead context, so they produce no frames.
            cache: the request's :class:`FlowStreamCache`. Used by streaming, non-final calls only:
                frames of attention blocks an earlier call of the request completed are taken from
                it instead of recomputed (same mel up to float rounding: ~1e-6 at fp32, where the
                reference DiT runs the same operations on the new rows only), and this call's
                complete blocks are added to it. Ignored by other calls.

        Returns:
            ``(1, 80, 2T)`` float32 natural-log mel (``2(T-3)`` frames when ``finalize`` is False),
            prompt frames removed, on this module's device.
        """
        inp = self.prepare(token, prompt_token, prompt_feat, embedding, finalize)
        if cache is not None and streaming and not finalize:
            dev = self.device
            key = (inp.prompt_frames, prompt_feat.to(dev, torch.float32), embedding.to(dev, torch.float32))
            feat = self.decoder.forward_cached(inp.mu, inp.spks, inp.cond, cache, key,
                                               self._ids(prompt_token, token))
        else:
            feat = self.decoder(inp.mu, inp.spks, inp.cond, streaming)
        return feat[:, :, inp.prompt_frames:]

    def _ids(self, prompt_token: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Prompt + token ids ``(1, P+T)`` as the token embedding reads them (ids clamped at >= 0)."""
        return torch.cat([prompt_token, token], dim=1).to(self.device, torch.long).clamp_min(0)

    def _check_inputs(self, token, prompt_token, prompt_feat, embedding, finalize) -> None:
        c = self.cfg
        for name, t in (("token", token), ("prompt_token", prompt_token)):
            if t.dim() != 2 or t.shape[0] != 1 or t.is_floating_point():
                raise InputError(f"flow {name} must be an integer tensor of shape (1, n), got "
                                 f"{t.dtype} {tuple(t.shape)}")
            if t.numel() and int(t.max()) >= c.vocab_size:
                raise InputError(f"flow {name} holds id {int(t.max())}; speech token ids are 0..{c.vocab_size - 1}")
        if prompt_feat.dim() != 3 or prompt_feat.shape[0] != 1 or prompt_feat.shape[2] != c.output_size \
                or prompt_feat.shape[1] != c.token_mel_ratio * prompt_token.shape[1]:
            raise InputError(f"flow prompt_feat must have shape (1, {c.token_mel_ratio}*P, {c.output_size}) "
                             f"with P = {prompt_token.shape[1]} prompt tokens, got {tuple(prompt_feat.shape)}")
        if tuple(embedding.shape) != (1, c.spk_embed_dim):
            raise InputError(f"flow embedding must have shape (1, {c.spk_embed_dim}), got {tuple(embedding.shape)}")
        need = 1 + (0 if finalize else c.pre_lookahead_len)
        if token.shape[1] < need:
            raise InputError(f"flow needs at least {need} tokens with finalize={finalize}, got {token.shape[1]}")
