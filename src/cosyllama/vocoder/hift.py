"""The HiFT generator, :class:`HiFT`: mel -> f0 -> source -> conv stack -> iSTFT -> waveform."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HiftConfig, ModelConfig
from ..device import on_true_fp32, resolve_device
from ..errors import InputError
from ..precision import INT8, is_auto, resolve_precision
from ..weight_copies import WeightCopies
from .fast import CHANNELS_LAST, FastGenerator
from .modules import (
    CONV_POST_KERNEL,
    F0_LOOKAHEAD,
    POST_SLOPE,
    F0Predictor,
    ResBlock,
    SourceModule,
    causal_conv,
    lookahead_conv,
    source_noise_state,
)
from .stream import VocoderStream, decoder_history_frames, new_stream, stream_step

GENERATOR_PARTS = ("conv_pre", "ups", "source_downs", "source_resblocks", "resblocks")


def _lowp_copies(hift: HiFT, dtype: torch.dtype) -> dict[str, nn.Module]:
    """The reference path's conv stack as module copies in ``dtype``."""
    with torch.no_grad():
        return {k: copy.deepcopy(getattr(hift, k)).to(dtype).eval() for k in GENERATOR_PARTS}


class HiFT(nn.Module):
    """Causal HiFT generator: ``inference(mel, finalize)`` -> waveform (see docs/reference.md#vocoder)."""

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
        # True: the channels-last conv stack (FastGenerator), prepared from the current weights on
        # first use. False: the module-by-module reference path (same math, ~1.5-2x slower on CPU).
        self.fast = True
        # Weight copies each path prepares, rebuilt when the weights change (cosyllama.weight_copies).
        self._fast_weights: WeightCopies[FastGenerator] = WeightCopies(FastGenerator)
        self._lowp_weights: WeightCopies[dict[str, nn.Module]] = WeightCopies(_lowp_copies)

    @property
    def _fast(self) -> FastGenerator | None:
        """The prepared fast stack, if one is current (None before first use)."""
        return self._fast_weights.value

    @property
    def _lowp(self) -> dict[str, nn.Module] | None:
        """The reference path's low-precision module copies, if prepared."""
        return self._lowp_weights.value

    def _fast_generator(self) -> FastGenerator:
        return self._fast_weights.get(self, self.compute_dtype)

    def _generator(self) -> dict[str, nn.Module]:
        """The conv stack in ``compute_dtype``: the modules themselves for float32, else copies."""
        if self.compute_dtype == torch.float32:
            return {k: getattr(self, k) for k in GENERATOR_PARTS}
        return self._lowp_weights.get(self, self.compute_dtype)

    def set_precision(self, precision: str | torch.dtype | None) -> torch.dtype:
        """``"fp32"`` (reference) or ``"bf16"`` (explicit opt-in: the generator convs up to the last
        resblock run in bfloat16; f0 predictor (float64), source, STFT, conv_post, iSTFT and the
        output stay as in the reference). ``"auto"`` resolves to fp32 here on every device: the bf16
        vocoder misses the fidelity bound on the fixture model (log-mel of its waveform, see
        ``tests/test_precision.py``), so it is never picked implicitly. ``"int8"`` (a flow
        precision: the vocoder has no int8 path) is fp32 here too. Returns the dtype chosen;
        :class:`InputError` for an unknown name."""
        dtype = resolve_precision(precision, self.device)
        if is_auto(precision) or dtype == INT8:
            dtype = torch.float32
        self.compute_dtype = dtype
        self._fast_weights.drop()
        self._lowp_weights.drop()
        # Prepare the weights the active path reads now, not inside the first request.
        self._fast_generator() if self.fast else self._generator()
        return self.compute_dtype

    @classmethod
    def from_config(cls, config: ModelConfig, device: str | torch.device = "cpu",
                    precision: str = "fp32") -> "HiFT":
        """Build from the model's parsed config and load its ``hift.pt`` strictly (either
        weight-norm key style, optional ``generator.`` prefix); float32 weights (f0 predictor
        float64), eval mode. ``precision``: see :meth:`set_precision`."""
        from ..weights import load_hift_weights

        dev = resolve_device(device)
        hift = cls(config.hift, source_noise_state(config.flow, config.hift))
        hift.load_state_dict(load_hift_weights(Path(config.model_dir) / "hift.pt", config.hift), strict=True)
        hift = hift.to(dev).eval()
        hift.set_precision(precision)
        return hift

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu",
                 precision: str = "fp32") -> "HiFT":
        """:meth:`from_config` on ``load_config(model_dir)``."""
        from ..config import load_config

        return cls.from_config(load_config(model_dir), device, precision)

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
        phase = torch.sin(x[:, bins:])  # sin() of the phase: see docs/reference.md#q8-sine-of-predicted-phase
        wav = torch.istft(torch.complex(mag * torch.cos(phase), mag * torch.sin(phase)), self.n_fft,
                          self.hop, self.n_fft, window=self.stft_window)
        if not finalize:
            wav = wav[:, :wav.shape[1] - self.samples_per_frame]
        return wav.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    @on_true_fp32
    def decode_fast(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """:meth:`decode` on the channels-last conv stack (see :class:`FastGenerator`)."""
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
        return new_stream(self)

    @on_true_fp32
    @torch.inference_mode()
    def stream_step(self, state: VocoderStream, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """Vocode the next mel frames of an utterance without re-running the earlier ones; see
        :func:`cosyllama.vocoder.stream.stream_step`."""
        return stream_step(self, state, mel, finalize)

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
