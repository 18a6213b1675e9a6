"""The vocoder's building blocks: the fixed source noise, Snake, causal convs, residual blocks,
the f0 predictor and the harmonic source. Attribute names equal the keys of ``hift.pt``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FlowConfig, HiftConfig
from ..errors import InputError
from ..flow.cfm import NOISE_FRAMES, NOISE_SEED

F0_LOOKAHEAD = 3  # mel frames condnet.0 reads ahead (k=4)
F0_CONV_KERNEL = 3
F0_LAYERS = 5  # condnet convs, each followed by ELU
F0_HISTORY = (F0_LAYERS - 1) * (F0_CONV_KERNEL - 1)  # mel frames back an f0 frame depends on (8)
CONV_POST_KERNEL = 7
POST_SLOPE = 0.01  # F.leaky_relu default; upstream uses it (not lrelu_slope) before conv_post
SNAKE_EPS = 1e-9
NOISE_SAMPLES = 7_200_000  # length of upstream's fixed source-noise buffer (300 s at 24 kHz)


# ----------------------------------------------------------------------------------------------
# Fixed source noise (see docs/reference.md#source-noise)


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
    # rand_ini has no effect on the output: see docs/reference.md#q5-unused-initial-phase
    rand_ini = torch.rand(1, hift.nb_harmonics + 1, generator=g)
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
    """Harmonic-plus-noise excitation: f0 ``(1, T)`` -> source ``(1, 1, T*up)``. See
    docs/reference.md#source-module."""

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
        # Upstream's causal source accumulates phase at frame rate: a linear down-sampling (which reads the
        # middle of each frame, where the per-sample values are all equal), cumsum, then a nearest up-sampling
        # — a staircase phase the model was trained with (see docs/reference.md#q6-staircase-phase). We use
        # the same ops so the float32 rounding is the same. Its random initial phase lands on sample 0, which
        # the down-sampling never reads (see docs/reference.md#q5-unused-initial-phase), so it is left out.
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
