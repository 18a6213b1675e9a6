"""The fast conv stack of the vocoder (the default): the same convolutions, laid out for oneDNN.

Activations are ``(1, C, 1, L)`` tensors in channels-last memory, i.e. time-major ``(L, C)``
rows. oneDNN's conv kernels read and write that layout directly, while the plain ``(1, C, L)``
layout costs a reorder of the input and of the output around every conv (measured: ~1/3 of the
stack's time). Time-major rows also make the causal bookkeeping free: a conv with symmetric
padding p followed by keeping the first L outputs equals left-padding p zeros (the extra outputs
on the right are never read, and a prefix of rows is still a dense channels-last tensor); and the
phases of a polyphase upsampling conv interleave by a mere reshape. Same arithmetic as the
reference path except the upsampling convs, whose taps that read the same input frame are
summed into one weight beforehand (float rounding only).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HiftConfig
from .modules import SNAKE_EPS, ResBlock, Snake


class ConvStack(Protocol):
    """The modules of a :class:`~cosyllama.vocoder.hift.HiFT` that :class:`FastGenerator` re-lays out."""

    cfg: HiftConfig
    conv_pre: nn.Conv1d
    ups: nn.ModuleList
    source_downs: nn.ModuleList
    source_resblocks: nn.ModuleList
    resblocks: nn.ModuleList
    conv_post: nn.Conv1d


CHANNELS_LAST = torch.channels_last


def _cl_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Conv1d weight ``(out, in, k)`` -> ``(out, in, 1, k)`` channels-last, in ``dtype``."""
    return w.detach()[:, :, None, :].to(dtype).contiguous(memory_format=CHANNELS_LAST)


class _FastConv:
    """A conv1d on ``(1, C, 1, L)`` channels-last activations: causal (left zero padding
    ``(k-1)*dilation``, output length L) when ``causal``, else unpadded."""

    __slots__ = ("weight", "bias", "dilation", "stride", "pad")

    def __init__(self, conv: nn.Conv1d, dtype: torch.dtype, causal: bool = True):
        self.weight, self.bias = _cl_weight(conv.weight, dtype), conv.bias.detach().to(dtype)
        self.dilation, self.stride = conv.dilation[0], conv.stride[0]
        self.pad = (conv.kernel_size[0] - 1) * self.dilation if causal else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x, self.weight, self.bias, stride=(1, self.stride), padding=(0, self.pad),
                     dilation=(1, self.dilation))
        return y[..., :x.shape[3]] if self.pad else y

    def padded(self, xp: torch.Tensor) -> torch.Tensor:
        """The causal conv of ``x`` given ``xp`` = x with its ``pad`` leading zero rows already in
        place (see :meth:`_FastSnake.__call__`). oneDNN's own padding is slow for the dilated
        convs (up to 1.7x slower than this, measured: the k11/d5 conv at 64 x 60000)."""
        return F.conv2d(xp, self.weight, self.bias, stride=(1, self.stride), dilation=(1, self.dilation))


class _FastUpsample:
    """Nearest upsampling by ``rate`` then a left-causal conv (see docs/reference.md#hift-building-blocks)
    as one polyphase conv at the input rate: output sample ``rate*t + p`` only reads input frames
    ``t-D .. t``, so phase p is a conv with D+1 taps whose weights are the sums of the original taps
    that land on the same frame. The ``rate`` phases come out as ``rate*out`` channels, which in
    time-major memory is already the interleaved ``(rate*T, out)`` layout: a reshape, no copy.
    ``rate*(D+1)`` instead of ``rate*k`` taps per output frame (x3.6 fewer MACs for 8/16 ... 3/7)."""

    __slots__ = ("weight", "bias", "rate", "taps", "out")

    def __init__(self, conv: nn.Conv1d, rate: int, dtype: torch.dtype):
        w = conv.weight.detach().double()
        out, cin, k = w.shape
        self.rate, self.out = rate, out
        self.taps = -(-(k - 1) // rate) + 1  # D + 1
        poly = w.new_zeros(rate, out, cin, self.taps)
        for p in range(rate):
            for j in range(k):  # x_up[rate*t + p - (k-1) + j] = x[t + floor((p - (k-1) + j) / rate)]
                poly[p, :, :, (p - (k - 1) + j) // rate + self.taps - 1] += w[:, :, j]
        self.weight = _cl_weight(poly.reshape(rate * out, cin, self.taps), dtype)
        self.bias = conv.bias.detach().to(dtype).repeat(rate)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[3]
        y = F.conv2d(x, self.weight, self.bias, padding=(0, self.taps - 1))[..., :n]  # (1, r*out, 1, n)
        # rows of r*out values = r consecutive output rows of out values
        return y.permute(0, 2, 3, 1).reshape(1, 1, n * self.rate, self.out).permute(0, 3, 1, 2)


class _FastSnake:
    __slots__ = ("alpha", "inv")

    def __init__(self, snake: Snake, dtype: torch.dtype):
        self.alpha = snake.alpha.detach().to(dtype)[None, :, None, None]
        self.inv = 1.0 / (self.alpha + SNAKE_EPS)  # as the reference computes it, once

    def __call__(self, x: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """``x + inv * sin(x * alpha)^2`` in one buffer (the reference's ops in its order, so the
        result is bit-identical), preceded by ``pad`` zero rows: ``(1, C, 1, pad + L)``."""
        if pad:
            buf = torch.empty((1, x.shape[1], 1, pad + x.shape[3]), dtype=x.dtype, device=x.device,
                              memory_format=CHANNELS_LAST)
            buf[..., :pad].zero_()
            t = torch.mul(x, self.alpha, out=buf[..., pad:])
        else:
            buf = t = x * self.alpha
        t.sin_()
        t.mul_(t)  # == pow(2)
        t.mul_(self.inv)
        t.add_(x)
        return buf


class _FastResBlock:
    __slots__ = ("units",)

    def __init__(self, rb: ResBlock, dtype: torch.dtype):
        self.units = [(_FastSnake(a1, dtype), _FastConv(c1, dtype), _FastSnake(a2, dtype), _FastConv(c2, dtype))
                      for c1, c2, a1, a2 in zip(rb.convs1, rb.convs2, rb.activations1, rb.activations2)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for a1, c1, a2, c2 in self.units:
            t = c1.padded(a1(x, c1.pad))
            x = c2.padded(a2(t, c2.pad)).add_(x)  # x + t: fresh buffer, the input is left alone
        return x


class FastGenerator:
    """The conv stack of :class:`HiFT` (conv_pre .. resblocks, and conv_post in float32) prepared
    once per weights and dtype for the channels-last path."""

    def __init__(self, hift: ConvStack, dtype: torch.dtype):
        self.dtype = dtype
        with torch.no_grad():
            self.conv_pre = _FastConv(hift.conv_pre, dtype, causal=False)
            self.ups = [_FastUpsample(up, r, dtype) for up, r in zip(hift.ups, hift.cfg.upsample_rates)]
            self.source_downs = [_FastConv(d, dtype, causal=False) for d in hift.source_downs]
            self.source_resblocks = [_FastResBlock(rb, dtype) for rb in hift.source_resblocks]
            self.resblocks = [_FastResBlock(rb, dtype) for rb in hift.resblocks]
            self.conv_post = _FastConv(hift.conv_post, torch.float32)
