"""The flow's velocity estimator: a DiT over ``[x, cond, mu, spks]`` mel frames, and the
pre-lookahead conv over token embeddings. Module attribute names equal the keys of ``flow.pt``."""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FlowConfig


class StreamStep(Protocol):
    """What a streaming solve's Euler step hands the DiT as ``past`` (:class:`~cosyllama.flow.cache.StepCache`
    implements it): the first new frame, the position embedding of the new frames, and each block's K/V
    with the cached frames in front."""

    start: int

    def conv_pos(self, cpe: CausalConvPositionEmbedding, h: torch.Tensor) -> torch.Tensor: ...

    def kv(self, block: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


TIME_EMBED_DIM = 256  # sinusoidal time features fed to the DiT's time MLP
TIME_SCALE = 1000.0  # t in [0, 1] is scaled before the sinusoid
ROPE_BASE = 10_000.0
CONV_POS_KERNEL = 31
CONV_POS_GROUPS = 16
LN_EPS = 1e-6
LOOKAHEAD_SLOPE = 0.01  # F.leaky_relu default slope, as upstream uses in the pre-lookahead layer


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

    def forward(self, x, cond, mu, spks, past: StreamStep | None = None):
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

    With ``past`` (a :class:`StreamStep`, streaming only) x, mu, cond hold only frames
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
                past: StreamStep | None = None) -> torch.Tensor:
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
