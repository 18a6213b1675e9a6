"""Incremental (streaming) vocoding: one utterance's state, and the step that vocodes its next mel
frames from a window of context instead of re-running the whole utterance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import HiftConfig
from ..errors import InputError
from .modules import CONV_POST_KERNEL, F0_HISTORY, F0_LOOKAHEAD, NOISE_SAMPLES, SourceModule


class StreamingVocoder(Protocol):
    """What :func:`stream_step` uses of a :class:`~cosyllama.vocoder.hift.HiFT` (which passes itself): its
    config, device and frame geometry, the f0 predictor, the source module and the decoder."""

    cfg: HiftConfig
    device: torch.device
    samples_per_frame: int
    history_frames: int
    m_source: SourceModule

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor: ...

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor: ...


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
    """One utterance's progress through :func:`stream_step` (per request; never share one).
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


def new_stream(hift: StreamingVocoder) -> VocoderStream:
    """A fresh per-utterance state for :func:`stream_step`."""
    g = torch.Generator(device="cpu")
    g.set_state(hift.m_source.noise_state)
    return VocoderStream(phase=torch.zeros(1, hift.m_source.harmonics, 1, dtype=torch.float64), noise=g)

def stream_step(hift: StreamingVocoder, state: VocoderStream, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
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
    if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != hift.cfg.in_channels:
        raise InputError(f"vocoder mel must have shape (1, {hift.cfg.in_channels}, n), got {tuple(mel.shape)}")
    up = hift.samples_per_frame
    mel = mel.to(hift.device, torch.float32)
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
        f0 = hift.predict_f0(state.mel[:, :, lo - state.mel_start:], finalize)[:, state.f0_frames - lo:]
        src, state.phase = hift.m_source.continue_source(f0, state.phase, state.noise)
        state.source = src if state.source is None else torch.cat([state.source, src], dim=2)
        state.f0_frames = f0_end
    # Decoder on a window that starts history_frames before the first new sample.
    end = n if finalize else n - F0_LOOKAHEAD - hift.cfg.conv_pre_look_right - 1  # frames complete
    state.finished = finalize
    first = state.emitted // up
    if end <= first:  # nothing new yet (or a finalize call that adds nothing)
        return torch.zeros(1, 0, device=hift.device)
    start = max(first - hift.history_frames, 0)
    body_end = n if finalize else n - F0_LOOKAHEAD
    body = state.mel[:, :, start - state.mel_start:body_end - state.mel_start]
    src = state.source[:, :, (start - state.source_start) * up:(body_end - state.source_start) * up]
    wav = hift.decode(body, src, finalize)[:, state.emitted - start * up:]
    state.emitted = end * up
    # Forget what no later call reads.
    if finalize:
        state.mel = state.source = None
    else:
        keep = max(min(state.f0_frames - F0_HISTORY, end - hift.history_frames), state.mel_start)
        state.mel = state.mel[:, :, keep - state.mel_start:]
        state.mel_start = keep
        keep = max(end - hift.history_frames, state.source_start)
        state.source = state.source[:, :, (keep - state.source_start) * up:]
        state.source_start = keep
    return wav
