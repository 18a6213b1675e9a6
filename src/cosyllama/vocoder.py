"""Vocoder stage: causal HiFT (spec §8). 80-band log-mel at 50 frames/s -> 24 kHz waveform.

mel -> f0 (float64 conv predictor) -> harmonic sine source -> source STFT; mel -> conv_pre ->
3 x (nearest upsample + causal conv, add the down-sampled source, average of 3 Snake resblocks)
-> conv_post -> magnitude/phase -> iSTFT -> clamp. Every conv is causal except the two
look-ahead convs (f0 ``condnet.0``: 3 frames, ``conv_pre``: 4 frames), which is what makes
streaming by "re-run on the whole mel, emit only the new samples" exact (spec §8.4).

Speed: :meth:`HiFT.decode` runs the conv stack channels-last (:class:`_FastGenerator`; same math
as the module-by-module :meth:`HiFT.decode_reference`, up to float rounding). For streaming,
:meth:`HiFT.stream_step` gives the samples of that re-run scheme while computing only the new
frames plus the decoder's receptive field (:func:`decoder_history_frames`).

Module attribute names equal the keys of ``hift.pt`` after weight-norm folding
(:func:`cosyllama.weights.load_hift_weights`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import FlowConfig, HiftConfig, load_config
from .device import on_true_fp32, resolve_device
from .errors import InputError
from .flow import NOISE_FRAMES, NOISE_SEED
from .precision import resolve_precision

F0_LOOKAHEAD = 3  # mel frames condnet.0 reads ahead (k=4)
F0_CONV_KERNEL = 3
F0_LAYERS = 5  # condnet convs, each followed by ELU
F0_HISTORY = (F0_LAYERS - 1) * (F0_CONV_KERNEL - 1)  # mel frames back an f0 frame depends on (8)
CONV_POST_KERNEL = 7
POST_SLOPE = 0.01  # F.leaky_relu default; upstream uses it (not lrelu_slope) before conv_post
SNAKE_EPS = 1e-9
NOISE_SAMPLES = 7_200_000  # length of upstream's fixed source-noise buffer (300 s at 24 kHz)


# ----------------------------------------------------------------------------------------------
# Fixed source noise (spec §11)


def replay_source_rng(flow: FlowConfig, hift: HiftConfig) -> tuple[torch.Generator, torch.Tensor]:
    """A private CPU generator positioned right before upstream draws ``SineGen2.sine_waves``, and
    the ``rand_ini`` ``(1, 9)`` drawn just before (column 0 zeroed, as upstream does).

    Upstream draws these from the global RNG during model construction, after seeding 0 for the
    flow noise and after the default initialisation of a few layers. We replay exactly those draws
    (same ops, same shapes, same order); their values are thrown away, only the generator position
    matters. The global RNG is never touched."""
    g = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    torch.randn(1, flow.mel_dim, NOISE_FRAMES, generator=g)  # flow ODE noise
    torch.empty(flow.vocab_size, flow.input_size).normal_(generator=g)  # flow.input_embedding

    def linear_or_conv(*weight_shape: int) -> None:  # kaiming-uniform weight, then uniform bias
        torch.empty(*weight_shape).uniform_(generator=g)
        torch.empty(weight_shape[0]).uniform_(generator=g)

    linear_or_conv(flow.output_size, flow.spk_embed_dim)  # flow.spk_embed_affine_layer
    cc = hift.f0_cond_channels
    linear_or_conv(cc, hift.f0_in_channels, F0_LOOKAHEAD + 1)
    for _ in range(F0_LAYERS - 1):
        linear_or_conv(cc, cc, F0_CONV_KERNEL)
    linear_or_conv(hift.f0_num_class, cc)
    rand_ini = torch.rand(1, hift.nb_harmonics + 1, generator=g)  # has no effect on output (spec Q5)
    rand_ini[:, 0] = 0
    return g, rand_ini


def source_noise_state(flow: FlowConfig, hift: HiftConfig) -> torch.Tensor:
    """Generator state (a CPU ByteTensor) from which :func:`source_noise` draws the buffer."""
    return replay_source_rng(flow, hift)[0].get_state()


def source_noise(state: torch.Tensor, samples: int, harmonics: int) -> torch.Tensor:
    """First ``samples`` rows of upstream's uniform [0, 1) buffer ``(1, 7.2M, harmonics)``:
    ``(1, samples, harmonics)`` float32 on CPU. ``torch.rand`` fills sequentially, so drawing only
    the prefix from the saved state gives the same values as slicing the full buffer."""
    if samples > NOISE_SAMPLES:
        raise InputError(f"vocoder input of {samples} samples exceeds the {NOISE_SAMPLES}-sample (300 s) "
                         "source-noise buffer")
    g = torch.Generator(device="cpu")
    g.set_state(state)
    return torch.rand(1, samples, harmonics, generator=g)


# ----------------------------------------------------------------------------------------------
# Building blocks


class Snake(nn.Module):
    """``x + sin(alpha x)^2 / (alpha + 1e-9)`` per channel; x ``(B, C, T)``."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.alpha[None, :, None]
        return x + (1.0 / (a + SNAKE_EPS)) * torch.sin(x * a).pow(2)


def causal_conv(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Left-pad ``(k-1)*dilation`` zeros so output length = input length and nothing reads ahead."""
    return conv(F.pad(x, ((conv.kernel_size[0] - 1) * conv.dilation[0], 0)))


def lookahead_conv(conv: nn.Conv1d, x: torch.Tensor, finalize: bool) -> torch.Tensor:
    """Conv reading ``k-1`` frames ahead. ``finalize``: append zeros (output length T). Otherwise
    the last ``k-1`` input frames are only context (output length T-(k-1))."""
    right = conv.kernel_size[0] - 1
    return conv(F.pad(x, (0, right)) if finalize else x)


class ResBlock(nn.Module):
    """Three (Snake, dilated causal conv, Snake, causal conv) residual units; ``(B, C, T)`` -> same."""

    def __init__(self, channels: int, kernel: int, dilations):
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel, dilation=d) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = x + causal_conv(c2, a2(causal_conv(c1, a1(x))))
        return x


class F0Predictor(nn.Module):
    """mel ``(B, 80, T)`` -> f0 ``(B, T)`` in Hz (``T-3`` when not finalizing). Runs in float64
    like upstream: its parameters are float64 and the input is cast."""

    def __init__(self, in_channels: int, channels: int, num_class: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv1d(in_channels, channels, F0_LOOKAHEAD + 1), nn.ELU()]
        for _ in range(F0_LAYERS - 1):
            layers += [nn.Conv1d(channels, channels, F0_CONV_KERNEL), nn.ELU()]
        self.condnet = nn.ModuleList(layers)  # convs at even indices, as in the checkpoint keys
        self.classifier = nn.Linear(channels, num_class)
        self.double()

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        x = mel.to(torch.float64)
        x = self.condnet[1](lookahead_conv(self.condnet[0], x, finalize))
        for i in range(2, len(self.condnet), 2):
            x = self.condnet[i + 1](causal_conv(self.condnet[i], x))
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


class SourceModule(nn.Module):
    """Harmonic-plus-noise excitation (spec §8.3 step 3-4): f0 ``(1, T)`` -> source ``(1, 1, T*up)``."""

    def __init__(self, cfg: HiftConfig, upsample: int, noise_state: torch.Tensor):
        super().__init__()
        self.harmonics = cfg.nb_harmonics + 1
        self.upsample = upsample
        self.sample_rate = cfg.sampling_rate
        self.sine_amp, self.noise_std = cfg.nsf_alpha, cfg.nsf_sigma
        self.voiced_threshold = cfg.nsf_voiced_threshold
        self.noise_state = noise_state
        self.l_linear = nn.Linear(self.harmonics, 1)

    def sine_waves(self, f0: torch.Tensor) -> torch.Tensor:
        """The 9 noisy harmonics before merging: ``(1, T*up, 9)`` float32, on ``f0``'s device."""
        dev = f0.device
        # The phase is computed on the CPU whatever the device: it is a running sum over the whole
        # utterance multiplied by 480*2*pi, so a one-ulp difference in an increment (CUDA divides
        # by a scalar through its reciprocal) or in a rounded partial sum (a parallel float64 scan)
        # moves the sine by ~1e-3 and the waveform by far more (measured on an H200: 7e-3).
        f0_cpu = f0.float().cpu().repeat_interleave(self.upsample, dim=1)[:, :, None]  # (1, L, 1)
        f0_up = f0_cpu.to(dev)
        mult = torch.arange(1, self.harmonics + 1, dtype=torch.float32)
        rad = (f0_cpu * mult / self.sample_rate) % 1  # phase increment per sample, in turns
        # Upstream's causal source accumulates phase at frame rate: a linear down-sampling (which
        # reads the middle of each frame, where the per-sample values are all equal), cumsum, then a
        # nearest up-sampling — a staircase phase the model was trained with (spec Q6). We use the
        # same ops so the float32 rounding is the same. Its random initial phase lands on sample 0,
        # which the down-sampling never reads (spec Q5), so it is left out.
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample, mode="linear")
        # torch.cumsum of float32 on CPU accumulates in float64 and rounds each partial sum: we say
        # so explicitly, and continue_source carries the float64 sum from one streaming call to the next.
        phase = torch.cumsum(rad.double(), dim=2).float() * 2 * math.pi
        phase = F.interpolate(phase * self.upsample, scale_factor=self.upsample, mode="nearest").to(dev)
        sines = torch.sin(phase).transpose(1, 2) * self.sine_amp
        uv = (f0_up > self.voiced_threshold).float()
        amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        noise = amp * source_noise(self.noise_state, f0_up.shape[1], self.harmonics).to(dev)
        return sines * uv + noise

    def forward(self, f0: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l_linear(self.sine_waves(f0))).transpose(1, 2)

    def continue_source(self, f0: torch.Tensor, phase: torch.Tensor,
                        noise: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The source of the next frames of an utterance: ``f0 (1, n)`` (frames i..i+n-1) ->
        ``((1, 1, n*up), phase)``, equal to those frames of :meth:`forward` on the utterance's whole
        f0. ``phase`` ``(1, harmonics, 1)`` float64 is the running phase sum (zeros at the start);
        ``noise`` is a CPU generator positioned at row ``i*up`` of the source-noise buffer.

        Why this is exact: the sine phase is the only state, a running sum over all frames, and
        :meth:`sine_waves` computes it with ``torch.cumsum`` on float32, which on CPU accumulates
        in float64 and rounds each partial sum to float32 — so continuing the float64 sum gives the
        same float32 phases. The per-sample increments are constant within a frame, and the linear
        down-sampling reads two equal samples with weights 1/2 each, so the frame increment is
        exactly the per-sample value computed at frame rate. Everything else is per sample."""
        up = self.upsample
        f0 = f0.float()
        mult = torch.arange(1, self.harmonics + 1, dtype=torch.float32)
        # On the CPU whatever the device, as in sine_waves.
        rad = ((f0.cpu()[:, :, None] * mult / self.sample_rate) % 1).transpose(1, 2)  # (1, H, n)
        acc = torch.cumsum(torch.cat([phase.to("cpu", torch.float64), rad.double()], dim=2), dim=2)
        cum = (acc[:, :, 1:].float() * 2 * math.pi).to(f0.device)  # the reference's float32 cumsum, then its ops
        sines = torch.sin(cum * up).repeat_interleave(up, dim=2).transpose(1, 2) * self.sine_amp
        uv = (f0 > self.voiced_threshold).float().repeat_interleave(up, dim=1)[:, :, None]
        amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        draws = torch.rand(1, f0.shape[1] * up, self.harmonics, generator=noise)
        src = torch.tanh(self.l_linear(sines * uv + amp * draws.to(f0.device))).transpose(1, 2)
        return src, acc[:, :, -1:]


# ----------------------------------------------------------------------------------------------
# Fast conv stack (the default): the same convolutions, laid out for oneDNN
#
# Activations are ``(1, C, 1, L)`` tensors in channels-last memory, i.e. time-major ``(L, C)``
# rows. oneDNN's conv kernels read and write that layout directly, while the plain ``(1, C, L)``
# layout costs a reorder of the input and of the output around every conv (measured: ~1/3 of the
# stack's time). Time-major rows also make the causal bookkeeping free: a conv with symmetric
# padding p followed by keeping the first L outputs equals left-padding p zeros (the extra outputs
# on the right are never read, and a prefix of rows is still a dense channels-last tensor); and the
# phases of a polyphase upsampling conv interleave by a mere reshape. Same arithmetic as the
# reference path except the upsampling convs, whose taps that read the same input frame are
# summed into one weight beforehand (float rounding only).

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
    """Nearest upsampling by ``rate`` then a left-causal conv (spec §8.1 ``CausalConv1dUpsample``)
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


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (module built under inference_mode) has no counter
        return -1


class _FastGenerator:
    """The conv stack of :class:`HiFT` (conv_pre .. resblocks, and conv_post in float32) prepared
    once per weights and dtype for the channels-last path."""

    def __init__(self, hift: "HiFT", dtype: torch.dtype, key: tuple):
        self.key, self.dtype = key, dtype
        with torch.no_grad():
            self.conv_pre = _FastConv(hift.conv_pre, dtype, causal=False)
            self.ups = [_FastUpsample(up, r, dtype) for up, r in zip(hift.ups, hift.cfg.upsample_rates)]
            self.source_downs = [_FastConv(d, dtype, causal=False) for d in hift.source_downs]
            self.source_resblocks = [_FastResBlock(rb, dtype) for rb in hift.source_resblocks]
            self.resblocks = [_FastResBlock(rb, dtype) for rb in hift.resblocks]
            self.conv_post = _FastConv(hift.conv_post, torch.float32)


# ----------------------------------------------------------------------------------------------
# Incremental (streaming) vocoding


def decoder_history_frames(cfg: HiftConfig) -> int:
    """Mel frames before an output frame that the decoder's output depends on: the causal receptive
    field of conv_pre .. iSTFT (for the real config 28.7 frames: the 120-sample stage-0 resblocks
    plus the 72-sample stage-0 source resblock dominate), rounded up, plus one frame of margin.
    Recomputing the decoder on a window that starts this many frames before the first wanted
    sample gives that sample exactly as a run over the whole mel would."""

    def reach(k: int, dilations) -> int:  # one ResBlock, in its own samples
        return (k - 1) * (sum(dilations) + len(dilations))

    ups = cfg.upsample_rates
    per_frame = [math.prod(ups[:i + 1]) for i in range(len(ups))]  # stage-i samples per mel frame
    stft = per_frame[-1]  # source-STFT frames per mel frame
    window = cfg.istft_n_fft / cfg.istft_hop_len / stft  # an STFT frame's span, in mel frames
    # From an output sample backwards: iSTFT overlap, conv_post, the reflected sample of the last stage.
    back = window + (CONV_POST_KERNEL - 1) / stft + 1 / stft
    worst = back
    for i in reversed(range(len(ups))):
        res = max(reach(k, d) for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        res /= per_frame[i]
        stride = stft // per_frame[i]
        src = reach(cfg.source_resblock_kernel_sizes[i], cfg.source_resblock_dilation_sizes[i]) / per_frame[i]
        worst = max(worst, back + res + src + (2 * stride if stride > 1 else 1) / stft + window)
        taps = -(-(cfg.upsample_kernel_sizes[i] - 1) // ups[i])  # input frames the upsampling conv reads back
        back += res + taps / (per_frame[i - 1] if i else 1)
    return math.ceil(max(worst, back)) + 1


@dataclass
class VocoderStream:
    """One utterance's progress through :meth:`HiFT.stream_step` (per request; never share one).
    Holds only what later calls read: the last mel frames, the last source samples, the running
    sine phase and the source-noise generator; independent of the utterance's length."""

    frames: int = 0  # mel frames received
    emitted: int = 0  # samples returned
    finished: bool = False
    mel: torch.Tensor | None = None  # (1, mel bins, n): received frames mel_start .. frames-1
    mel_start: int = 0
    f0_frames: int = 0  # the source exists for frames 0 .. f0_frames-1
    source: torch.Tensor | None = None  # (1, 1, up * n): source of frames source_start .. f0_frames-1
    source_start: int = 0
    phase: torch.Tensor | None = None  # (1, harmonics, 1) float64 running phase sum
    noise: torch.Generator | None = None  # at row up * f0_frames of the source-noise buffer


# ----------------------------------------------------------------------------------------------
# Generator


class HiFT(nn.Module):
    """Causal HiFT generator: ``inference(mel, finalize)`` -> waveform (spec §8)."""

    def __init__(self, cfg: HiftConfig, noise_state: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        ups, base = cfg.upsample_rates, cfg.base_channels
        self.n_fft, self.hop = cfg.istft_n_fft, cfg.istft_hop_len
        self.frame_upsample = math.prod(ups)  # source-STFT frames per mel frame
        self.samples_per_frame = self.frame_upsample * self.hop
        bins = self.n_fft // 2 + 1
        n_res = len(cfg.resblock_kernel_sizes)
        self.f0_predictor = F0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        self.m_source = SourceModule(cfg, self.samples_per_frame, noise_state)
        self.conv_pre = nn.Conv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1)
        self.ups = nn.ModuleList(nn.Conv1d(base >> i, base >> (i + 1), k)
                                 for i, k in enumerate(cfg.upsample_kernel_sizes))
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i in range(len(ups)):
            ch = base >> (i + 1)
            stride = math.prod(ups[i + 1:])  # source STFT rate / stage-i rate
            self.source_downs.append(nn.Conv1d(2 * bins, ch, 2 * stride, stride) if stride > 1
                                     else nn.Conv1d(2 * bins, ch, 1))
            self.source_resblocks.append(ResBlock(ch, cfg.source_resblock_kernel_sizes[i],
                                                  cfg.source_resblock_dilation_sizes[i]))
            for k, dil in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, k, dil))
        self.n_res = n_res
        self.history_frames = decoder_history_frames(cfg)
        self.conv_post = nn.Conv1d(base >> len(ups), 2 * bins, CONV_POST_KERNEL)
        # Periodic Hann computed in float64 then rounded, like upstream's scipy window.
        window = torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)
        # float32: the reference path. bfloat16 (opt-in): the generator convs (conv_pre .. the last
        # resblock) run on bf16 copies of their weights; f0 (float64), source, STFT, conv_post and
        # iSTFT stay as they are.
        self.compute_dtype = torch.float32
        self._lowp: dict[str, nn.Module] | None = None
        # True: the channels-last conv stack (_FastGenerator), prepared from the current weights on
        # first use. False: the module-by-module reference path (same math, ~1.5-2x slower on CPU).
        self.fast = True
        self._fast: _FastGenerator | None = None
        self.register_load_state_dict_post_hook(lambda *_: self._drop_lowp())

    def _drop_lowp(self) -> None:
        self._lowp = None
        self._fast = None

    def _weights_key(self) -> tuple:
        """Changes whenever a parameter is replaced or modified in place (load_state_dict, .to(),
        an optimizer step): the prepared fast weights are rebuilt then."""
        return tuple((id(p), _version(p)) for p in self.parameters())

    def _fast_generator(self) -> _FastGenerator:
        key = (self.compute_dtype, self._weights_key())
        if self._fast is None or self._fast.key != key:
            self._fast = _FastGenerator(self, self.compute_dtype, key)
        return self._fast

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda(): the low-precision copies must follow
        self._drop_lowp()
        return super()._apply(fn, *args, **kwargs)

    _GENERATOR_PARTS = ("conv_pre", "ups", "source_downs", "source_resblocks", "resblocks")

    def _generator(self) -> dict[str, nn.Module]:
        """The conv stack in ``compute_dtype``: the modules themselves for float32, else cached copies."""
        if self.compute_dtype == torch.float32:
            return {k: getattr(self, k) for k in self._GENERATOR_PARTS}
        if self._lowp is None or self._lowp["conv_pre"].weight.dtype != self.compute_dtype:
            with torch.no_grad():
                self._lowp = {k: copy.deepcopy(getattr(self, k)).to(self.compute_dtype).eval()
                              for k in self._GENERATOR_PARTS}
        return self._lowp

    def set_precision(self, precision: str | torch.dtype | None) -> torch.dtype:
        """``"fp32"`` (reference) or ``"bf16"`` (explicit opt-in: the generator convs up to the last
        resblock run in bfloat16; f0 predictor (float64), source, STFT, conv_post, iSTFT and the
        output stay as in the reference). ``"auto"`` resolves to fp32 here on every device: the bf16
        vocoder misses the fidelity bound on the fixture model (log-mel of its waveform, see
        ``tests/test_precision.py``), so it is never picked implicitly. Returns the dtype chosen;
        :class:`InputError` for an unknown name."""
        dtype = resolve_precision(precision, self.device)
        if isinstance(precision, str) and precision.strip().lower() == "auto":
            dtype = torch.float32
        self.compute_dtype = dtype
        self._drop_lowp()
        # Prepare the weights the active path reads now, not inside the first request.
        self._fast_generator() if self.fast else self._generator()
        return self.compute_dtype

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu",
                 precision: str = "fp32") -> "HiFT":
        """Build from ``cosyvoice3.yaml`` and load ``hift.pt`` strictly (either weight-norm key
        style, optional ``generator.`` prefix); float32 weights (f0 predictor float64), eval mode.
        ``precision``: see :meth:`set_precision`."""
        from .weights import load_hift_weights

        dev = resolve_device(device)
        cfg = load_config(model_dir)
        hift = cls(cfg.hift, source_noise_state(cfg.flow, cfg.hift))
        hift.load_state_dict(load_hift_weights(Path(cfg.model_dir) / "hift.pt", cfg.hift), strict=True)
        hift = hift.to(dev).eval()
        hift.set_precision(precision)
        return hift

    @property
    def device(self) -> torch.device:
        return self.conv_pre.weight.device

    # -- pieces -----------------------------------------------------------------------------

    @on_true_fp32
    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel ``(1, 80, T)`` -> f0 ``(1, T)`` float32 Hz (``T-3`` frames when not finalizing), on this
        module's device."""
        return self.f0_predictor(mel.to(self.device), finalize).float()

    @on_true_fp32
    def source(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 ``(1, T)`` -> excitation ``(1, 1, 480 T)`` float32, on this module's device."""
        return self.m_source(f0.to(self.device))

    @on_true_fp32
    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel ``(1, 80, T)`` and its source ``(1, 1, 480 T)`` -> waveform ``(1, 480 T)`` clamped to
        ±audio_limit; when not finalizing the last 4 mel frames are conv_pre look-ahead only and the
        result has ``480 (T-4)`` samples. Runs :meth:`decode_fast` or, with ``fast`` off,
        :meth:`decode_reference`."""
        if self.fast:
            return self.decode_fast(mel, source, finalize)
        return self.decode_reference(mel, source, finalize)

    def _source_stft(self, source: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(source.squeeze(1), self.n_fft, self.hop, self.n_fft, window=self.stft_window,
                          return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)  # (1, 2*bins, 120 T + 1)

    def _synthesize(self, x: torch.Tensor, finalize: bool) -> torch.Tensor:
        """conv_post output ``(1, 2*bins, F)`` float32 -> clamped waveform (magnitude/phase, iSTFT)."""
        bins = self.n_fft // 2 + 1
        mag = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])  # upstream takes sin() of the predicted phase (spec Q8)
        wav = torch.istft(torch.complex(mag * torch.cos(phase), mag * torch.sin(phase)), self.n_fft,
                          self.hop, self.n_fft, window=self.stft_window)
        if not finalize:
            wav = wav[:, :wav.shape[1] - self.samples_per_frame]
        return wav.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    @on_true_fp32
    def decode_fast(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """:meth:`decode` on the channels-last conv stack (see :class:`_FastGenerator`)."""
        g = self._fast_generator()
        dtype = g.dtype
        s = self._source_stft(source)
        if not finalize:
            s = s[:, :, :s.shape[2] - self.frame_upsample * self.cfg.conv_pre_look_right]
        s = s.to(dtype)
        mel = mel.to(dtype)
        if finalize:
            mel = F.pad(mel, (0, self.cfg.conv_pre_look_right))
        x = g.conv_pre(mel[:, :, None, :].contiguous(memory_format=CHANNELS_LAST))
        last = len(g.ups) - 1
        for i, (up, down) in enumerate(zip(g.ups, g.source_downs)):
            x = up(F.leaky_relu(x, self.cfg.lrelu_slope))
            if i == last:  # one reflected sample on the left (x[1]) aligns x with the STFT's extra frame
                x = torch.cat([x[..., 1:2], x], dim=3).contiguous(memory_format=CHANNELS_LAST)
            si = F.pad(s, (down.stride - 1, 0))[:, :, None, :].contiguous(memory_format=CHANNELS_LAST)
            x = x + g.source_resblocks[i](down(si))
            blocks = g.resblocks[i * self.n_res:(i + 1) * self.n_res]
            acc = blocks[0](x)
            for b in blocks[1:]:
                acc.add_(b(x))
            x = acc.div_(self.n_res)
        x = g.conv_post(F.leaky_relu(x.float(), POST_SLOPE))
        return self._synthesize(x[:, :, 0, :], finalize)

    @on_true_fp32
    def decode_reference(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """:meth:`decode` module by module, in the layout and op order of upstream."""
        s = self._source_stft(source)
        g = self._generator()  # the conv stack in compute_dtype (these modules for float32)
        dtype = self.compute_dtype
        x = lookahead_conv(g["conv_pre"], mel.to(dtype), finalize)
        s = s.to(dtype)
        if not finalize:
            s = s[:, :, :s.shape[2] - self.frame_upsample * self.cfg.conv_pre_look_right]
        for i, (up, rate) in enumerate(zip(g["ups"], self.cfg.upsample_rates)):
            x = F.leaky_relu(x, self.cfg.lrelu_slope)
            x = causal_conv(up, x.repeat_interleave(rate, dim=2))
            if i == len(g["ups"]) - 1:
                # One reflected sample on the left aligns x with the source STFT's extra frame.
                x = F.pad(x, (1, 0), mode="reflect")
            down = g["source_downs"][i]
            si = down(F.pad(s, (down.stride[0] - 1, 0)))
            x = x + g["source_resblocks"][i](si)
            blocks = g["resblocks"][i * self.n_res:(i + 1) * self.n_res]
            acc = blocks[0](x)
            for b in blocks[1:]:
                acc = acc + b(x)
            x = acc / self.n_res
        # conv_post stays float32: exp() of its magnitude half would amplify bf16 rounding.
        x = causal_conv(self.conv_post, F.leaky_relu(x.float(), POST_SLOPE))
        return self._synthesize(x, finalize)

    # -- incremental streaming ------------------------------------------------------------

    def new_stream(self) -> VocoderStream:
        """A fresh per-utterance state for :meth:`stream_step`."""
        g = torch.Generator(device="cpu")
        g.set_state(self.m_source.noise_state)
        return VocoderStream(phase=torch.zeros(1, self.m_source.harmonics, 1, dtype=torch.float64), noise=g)

    @on_true_fp32
    @torch.inference_mode()
    def stream_step(self, state: VocoderStream, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Vocode the next mel frames of an utterance without re-running the earlier ones.

        Appends ``mel`` ``(1, 80, n)`` (n >= 0) to the utterance and returns the samples that
        ``inference(all mel so far, finalize)`` returns beyond those already returned, as
        ``(1, m)`` float32 — equal to them up to float rounding (the f0 and source are continued
        exactly; the decoder is re-run on a window reaching :attr:`history_frames` before the new
        samples, which covers its receptive field). ``m`` may be 0 (fewer than 9 frames so far and
        not finalizing). After a ``finalize=True`` call the state is spent.

        Cost per call: the new frames plus about ``history_frames + 8`` frames of context,
        instead of the whole utterance."""
        if state.finished:
            raise InputError("this vocoder stream was already finalized; start a new one with new_stream()")
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.cfg.in_channels:
            raise InputError(f"vocoder mel must have shape (1, {self.cfg.in_channels}, n), got {tuple(mel.shape)}")
        up = self.samples_per_frame
        mel = mel.to(self.device, torch.float32)
        state.mel = mel if state.mel is None else torch.cat([state.mel, mel], dim=2)
        state.frames += mel.shape[2]
        n = state.frames
        if n * up > NOISE_SAMPLES:
            raise InputError(f"vocoder input of {n * up} samples exceeds the {NOISE_SAMPLES}-sample (300 s) "
                             "source-noise buffer")
        # f0 and source of the frames whose f0 look-ahead is now known.
        f0_end = n if finalize else max(n - F0_LOOKAHEAD, 0)
        if f0_end > state.f0_frames:
            lo = max(state.f0_frames - F0_HISTORY, state.mel_start)
            f0 = self.predict_f0(state.mel[:, :, lo - state.mel_start:], finalize)[:, state.f0_frames - lo:]
            src, state.phase = self.m_source.continue_source(f0, state.phase, state.noise)
            state.source = src if state.source is None else torch.cat([state.source, src], dim=2)
            state.f0_frames = f0_end
        # Decoder on a window that starts history_frames before the first new sample.
        end = n if finalize else n - F0_LOOKAHEAD - self.cfg.conv_pre_look_right - 1  # frames complete
        state.finished = finalize
        first = state.emitted // up
        if end <= first:  # nothing new yet (or a finalize call that adds nothing)
            return torch.zeros(1, 0, device=self.device)
        start = max(first - self.history_frames, 0)
        body_end = n if finalize else n - F0_LOOKAHEAD
        body = state.mel[:, :, start - state.mel_start:body_end - state.mel_start]
        src = state.source[:, :, (start - state.source_start) * up:(body_end - state.source_start) * up]
        wav = self.decode(body, src, finalize)[:, state.emitted - start * up:]
        state.emitted = end * up
        # Forget what no later call reads.
        if finalize:
            state.mel = state.source = None
        else:
            keep = max(min(state.f0_frames - F0_HISTORY, end - self.history_frames), state.mel_start)
            state.mel = state.mel[:, :, keep - state.mel_start:]
            state.mel_start = keep
            keep = max(end - self.history_frames, state.source_start)
            state.source = state.source[:, :, (keep - state.source_start) * up:]
            state.source_start = keep
        return wav

    # -- entry point --------------------------------------------------------------------------

    @on_true_fp32
    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Vocode a mel.

        Args:
            mel: ``(1, 80, T)`` float natural-log mel at 50 frames/s (the flow's output).
            finalize: True when ``mel`` ends the utterance. False for a streaming prefix: the last
                8 frames serve only as look-ahead (3 for f0, 4 for conv_pre, 1 of iSTFT overlap), and
                the ``480 (T-8)`` samples returned equal the first samples a later finalizing call on
                a longer mel returns — so a streamer re-runs on the whole mel and emits the new tail.

        Returns:
            ``(1, 480 T)`` float32 waveform at 24 kHz in [-0.99, 0.99] (``480 (T-8)`` samples when
            not finalizing), on this module's device.
        """
        need = 1 if finalize else F0_LOOKAHEAD + self.cfg.conv_pre_look_right + 2
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.cfg.in_channels or mel.shape[2] < need:
            raise InputError(f"vocoder mel must have shape (1, {self.cfg.in_channels}, T) with T >= {need} "
                             f"(finalize={finalize}), got {tuple(mel.shape)}")
        mel = mel.to(self.device, torch.float32)
        f0 = self.predict_f0(mel, finalize)
        body = mel if finalize else mel[:, :, :mel.shape[2] - F0_LOOKAHEAD]
        return self.decode(body, self.source(f0), finalize)
