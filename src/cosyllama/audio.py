"""Audio input and the three prompt feature extractors (see docs/reference.md#prompt-audio).

* reading (soundfile: wav, flac, ogg, mp3, ...), mixing to mono, resampling to 16 and 24 kHz;
* Whisper-style 128-bin log-mel at 16 kHz (speech tokenizer input);
* Kaldi fbank, 80 bins at 16 kHz, with mean removal (speaker encoder input);
* Matcha-style 80-bin natural-log mel at 24 kHz (the flow prompt).

torchaudio and librosa are not dependencies (torchaudio has no build beside current torch); the
resampler, the Kaldi fbank and the Slaney mel filterbank below are short re-derivations of the
same formulas and match the reference recordings to float32 rounding.
All waveforms are float32 in [-1, 1], shaped ``(1, N)`` like the reference tensors.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import torch
import torch.nn.functional as F

from .config import FeatConfig
from .errors import InputError

AudioSource = Union[str, os.PathLike, bytes, BinaryIO]

TOKENIZER_SAMPLE_RATE = 16_000  # Hz: speech tokenizer and speaker encoder input
MIN_FILE_SAMPLE_RATE = 16_000  # Hz: the reference refuses files below this (no upsampling from 8 kHz)
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer's limit
MIN_PROMPT_SECONDS = 0.1  # shorter clips give no speech token / mel frame
SILENCE_RMS = 1e-3  # a clip whose RMS after removing its DC offset is at or below -60 dBFS has no signal
MAX_PEAK = 4.0  # |sample| above +12 dBFS: a float file not scaled to [-1, 1] (a few dB over is a clipped export)
MAX_CHANNELS = 8  # more is no speech recording; with the rate bound, bounds what one second decodes to
MAX_FILE_SAMPLE_RATE = 192_000  # Hz: the highest common recording rate

WHISPER_N_FFT, WHISPER_HOP, WHISPER_N_MELS = 400, 160, 128  # 25 ms window, 10 ms hop at 16 kHz
KALDI_FRAME, KALDI_SHIFT, KALDI_N_FFT, KALDI_N_MELS = 400, 160, 512, 80
KALDI_LOW_HZ = 20.0
KALDI_PREEMPH = 0.97
KALDI_POVEY_POWER = 0.85
FLOAT32_EPS = float(np.finfo(np.float32).eps)  # Kaldi's log floor (1.1920929e-07)


# ----------------------------------------------------------------------------------------------
# Reading


def source_name(source: AudioSource) -> str:
    """How an audio source is named in messages: its path, or '' for bytes and file objects."""
    return repr(str(source)) if isinstance(source, (str, os.PathLike)) else ""


def describe(what: str, source: AudioSource) -> str:
    """``what`` followed by the source's path when it has one: "prompt audio 'a.wav'"."""
    name = source_name(source)
    return f"{what} {name}" if name else what


def read_audio(source: AudioSource, what: str = "audio",
               max_seconds: float | None = None) -> tuple[torch.Tensor, int]:
    """Decode an audio file (path, bytes or binary file object) to mono.

    Returns ``(wav, sample_rate)`` with ``wav`` float32 ``(1, N)`` = mean of the channels.
    Raises :class:`InputError` (its message starts with ``what``) for a missing or undecodable
    file, more than :data:`MAX_CHANNELS` channels, a rate above :data:`MAX_FILE_SAMPLE_RATE`,
    samples that are not finite numbers (NaN or infinity, which a float WAV can hold), or, with
    ``max_seconds``, more audio than that: the file is decoded only up to that length, so a small
    compressed upload cannot unpack into gigabytes.
    """
    import soundfile as sf

    named = describe(what, source)
    if isinstance(source, (str, os.PathLike)):
        if not Path(source).is_file():
            raise InputError(f"{what} file {source_name(source)} does not exist")
        handle = source
    elif isinstance(source, (bytes, bytearray)):
        handle = io.BytesIO(bytes(source))
    else:
        handle = source
    try:
        with sf.SoundFile(handle) as f:
            sr, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
            if channels > MAX_CHANNELS:
                raise InputError(f"{named} has {channels} channels; at most {MAX_CHANNELS} are supported "
                                 "(it is mixed to mono)")
            if sr > MAX_FILE_SAMPLE_RATE:
                raise InputError(f"{named} has a sample rate of {sr} Hz; at most {MAX_FILE_SAMPLE_RATE} Hz "
                                 "is supported")
            limit = None if max_seconds is None else int(max_seconds * sr)
            if limit is not None and frames > limit:
                raise InputError(_too_long(named, frames / sr, max_seconds))
            data = f.read(-1 if limit is None else limit + 1, dtype="float32", always_2d=True)
    except InputError:
        raise
    except Exception as e:  # libsndfile reports every decoding problem through its own error types
        reason = getattr(e, "error_string", None) or str(e)  # its str() holds the repr of a file object
        raise InputError(f"{named} is not a readable audio file ({reason.rstrip('.')}); "
                         "give a wav, flac, ogg or mp3 file") from e
    if limit is not None and data.shape[0] > limit:  # the header understated the length
        raise InputError(_too_long(named, None, max_seconds))
    finite = np.isfinite(data)
    if not finite.all():
        bad = int(data.size - np.count_nonzero(finite))
        raise InputError(f"{named} holds samples that are not finite numbers (NaN or infinity: {bad} of "
                         f"{data.size}); re-export it as 16-bit PCM or as float with finite samples")
    wav = torch.from_numpy(np.ascontiguousarray(data.T))  # (C, N)
    return wav.mean(dim=0, keepdim=True), sr


def _too_long(named: str, seconds: float | None, max_seconds: float) -> str:
    length = "" if seconds is None else f"{seconds:.1f} s long; "
    return (f"{named} is {length}at most {max_seconds:.0f} s is allowed (the speech tokenizer's limit): "
            "cut it to a 3-15 s clip")


def check_prompt_audio(wav: torch.Tensor, sample_rate: int, what: str = "prompt audio") -> None:
    """Refuse audio the frontend cannot use: below 16 kHz, empty, too short, over 30 s, samples
    far outside [-1, 1] (above :data:`MAX_PEAK`), or no signal: the RMS after removing the mean
    (the DC offset) at or below :data:`SILENCE_RMS` (silence, a constant)."""
    n = wav.shape[-1]
    _check_rate(sample_rate, what)
    if n == 0:
        raise InputError(f"{what} is empty (0 samples)")
    seconds = n / sample_rate
    if seconds < MIN_PROMPT_SECONDS:
        raise InputError(f"{what} is too short ({seconds:.3f} s); at least {MIN_PROMPT_SECONDS} s is needed")
    if seconds > MAX_PROMPT_SECONDS:
        raise InputError(_too_long(what, seconds, MAX_PROMPT_SECONDS))
    peak = float(wav.abs().max())
    if not math.isfinite(peak):  # audio read elsewhere than read_audio
        raise InputError(f"{what} holds samples that are not finite numbers (NaN or infinity)")
    if peak > MAX_PEAK:
        raise InputError(f"{what} holds samples far outside [-1, 1] (peak {peak:.3g}, at most {MAX_PEAK:g} allowed); "
                         "give audio scaled to [-1, 1] (e.g. 16-bit PCM)")
    x = wav.double()
    offset = float(x.mean())
    rms = float((x - offset).pow(2).mean().sqrt())
    if rms <= SILENCE_RMS:
        kind = "constant (a DC offset, no sound)" if abs(offset) > SILENCE_RMS else "silent"
        raise InputError(f"{what} has no signal: it is {kind}, its RMS after removing the mean ({offset:.3g}) is "
                         f"{rms:.2e}, at most {SILENCE_RMS:g} = -60 dBFS; give a recording of speech")


def _check_rate(sample_rate: int, what: str) -> None:
    if sample_rate < MIN_FILE_SAMPLE_RATE:
        raise InputError(f"{what} has a sample rate of {sample_rate} Hz; at least {MIN_FILE_SAMPLE_RATE} Hz "
                         "is needed (record or export it at 16, 22.05, 24, 44.1 or 48 kHz)")


@dataclass(frozen=True)
class PromptAudio:
    """A prompt clip read once and resampled for both front-ends."""

    wav16: torch.Tensor  # float32 (1, N16) at 16 kHz: speech tokens, speaker embedding
    wav24: torch.Tensor  # float32 (1, N24) at the model rate (24 kHz): flow prompt mel
    sample_rate: int  # the model rate of wav24, Hz


def load_prompt_audio(source: AudioSource, sample_rate: int = 24_000, what: str = "prompt audio") -> PromptAudio:
    """Read, check (:func:`check_prompt_audio`) and resample a prompt clip to 16 kHz and ``sample_rate``."""
    wav, sr = read_audio(source, what, max_seconds=MAX_PROMPT_SECONDS)
    check_prompt_audio(wav, sr, describe(what, source))
    return PromptAudio(resample(wav, sr, TOKENIZER_SAMPLE_RATE), resample(wav, sr, sample_rate), sample_rate)


def load_wav(source: AudioSource, target_sr: int) -> torch.Tensor:
    """The reference's ``load_wav``: mono float32 ``(1, N)`` at ``target_sr``; files below 16 kHz refused."""
    wav, sr = read_audio(source)
    _check_rate(sr, describe("audio", source))
    return resample(wav, sr, target_sr)


# ----------------------------------------------------------------------------------------------
# Resampling


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, width_zeros: int, rolloff: float) -> tuple[torch.Tensor, int]:
    """Polyphase windowed-sinc kernel, float32 ``(new, 1, 2*width + orig)``, and the half width.

    ``orig``/``new`` are the rates divided by their gcd. Output phase k of a block sits at input
    position k*orig/new; its filter is a low-pass sinc at ``min(orig, new) * rolloff`` (in units
    of the reduced rates) tapered by a Hann window reaching zero ``width_zeros`` zero-crossings
    away. Computed in float64 except the phase offsets k/new, which the reference forms in
    float32 before promotion; we do the same so the taps agree to the last bit.
    """
    cutoff = min(orig, new) * rolloff
    width = math.ceil(width_zeros * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    phase = (torch.arange(0, -new, -1)[:, None, None] / new).to(torch.float64)  # float32 division first
    t = ((phase + taps) * cutoff).clamp(-width_zeros, width_zeros)
    window = torch.cos(t * math.pi / width_zeros / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=t.dtype), torch.sin(t) / t)
    return (sinc * window * (cutoff / orig)).to(torch.float32), width


def resample(wav: torch.Tensor, orig_sr: int, new_sr: int, width_zeros: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """Band-limited resampling of float32 ``(..., N)`` to ``ceil(N * new_sr / orig_sr)`` samples.

    Same formula as the reference's torchaudio ``Resample`` defaults (Hann-windowed sinc, 6
    zero-crossings, rolloff 0.99), written here because torchaudio cannot be installed beside the
    torch we target. Returns the input unchanged when the rates are equal.
    """
    if orig_sr == new_sr:
        return wav
    g = math.gcd(int(orig_sr), int(new_sr))
    orig, new = int(orig_sr) // g, int(new_sr) // g
    kernel, width = _sinc_kernel(orig, new, width_zeros, rolloff)
    shape = wav.shape
    x = wav.reshape(-1, shape[-1])
    n = x.shape[-1]
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x[:, None], kernel.to(x.dtype), stride=orig)  # (B, new, blocks): phase-major
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    out_len = math.ceil(new * n / orig)
    return y[:, :out_len].reshape(*shape[:-1], -1)


# ----------------------------------------------------------------------------------------------
# Mel filterbanks


def _hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    """Slaney's auditory mel scale: linear (3 bins per 200 Hz) up to 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / (200.0 / 3)
    log_step = math.log(6.4) / 27.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / log_step, linear)


def _mel_to_hz_slaney(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * (200.0 / 3))


@lru_cache(maxsize=8)
def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> np.ndarray:
    """Triangular mel filters on the Slaney scale with Slaney area normalization.

    Returns float32 ``(n_mels, n_fft // 2 + 1)``. Band i rises from edge i to edge i+1 and falls to
    edge i+2, with ``n_mels + 2`` edges equally spaced in mel between ``fmin`` and ``fmax``
    (default Nyquist); each band is scaled by ``2 / (edge[i+2] - edge[i])`` (Hz) so all have equal
    area. This is the filterbank librosa's ``filters.mel`` gives (Whisper's ``mel_filters.npz``
    and Matcha's feature extractor use it), including its float32 rounding order.
    """
    fmax = sample_rate / 2 if fmax is None else fmax
    bins = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    widths = np.diff(edges)
    dist = edges[:, None] - bins[None, :]
    rising = -dist[:-2] / widths[:-1, None]
    falling = dist[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # in place: keeps float32, as the reference
    return weights


@lru_cache(maxsize=4)
def _kaldi_mel_banks(n_mels: int, n_fft: int, sample_rate: int, low_hz: float) -> torch.Tensor:
    """Kaldi's triangular filters on the HTK-style mel scale ``1127 ln(1 + f/700)``.

    float32 ``(n_mels, n_fft // 2 + 1)``: triangles equally spaced in mel between ``low_hz`` and
    Nyquist, evaluated at the FFT bin frequencies, not area-normalized; the Nyquist column is 0.
    Computed in float32 like torchaudio's Kaldi-compatible implementation.
    """
    def mel(f):
        return 1127.0 * torch.log(1.0 + f / 700.0)

    mel_low = 1127.0 * math.log(1.0 + low_hz / 700.0)
    mel_high = 1127.0 * math.log(1.0 + (sample_rate / 2) / 700.0)
    delta = (mel_high - mel_low) / (n_mels + 1)
    b = torch.arange(n_mels).unsqueeze(1)
    left, center, right = (mel_low + (b + k) * delta for k in (0, 1.0, 2.0))
    freqs = mel((sample_rate / n_fft) * torch.arange(n_fft // 2)).unsqueeze(0)
    up = (freqs - left) / (center - left)
    down = (right - freqs) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return F.pad(banks, (0, 1))


# ----------------------------------------------------------------------------------------------
# Feature extractors


def whisper_log_mel(wav16: torch.Tensor, n_mels: int = WHISPER_N_MELS) -> torch.Tensor:
    """Whisper log-mel of 16 kHz audio ``(1, N)`` -> float32 ``(1, n_mels, N // 160)``.

    Centered STFT (n_fft 400, hop 160, periodic Hann, reflect padding) with the last frame
    dropped, power spectrum, Slaney mel, ``log10`` floored at 1e-10, then clipped to 8 below the
    maximum over the whole input and mapped by ``(x + 4) / 4``.
    """
    window = torch.hann_window(WHISPER_N_FFT)
    spec = torch.stft(wav16, WHISPER_N_FFT, WHISPER_HOP, window=window, return_complex=True)
    power = spec[..., :-1].abs() ** 2
    filters = torch.from_numpy(slaney_mel_filterbank(TOKENIZER_SAMPLE_RATE, WHISPER_N_FFT, n_mels))
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav16: torch.Tensor, n_mels: int = KALDI_N_MELS) -> torch.Tensor:
    """Kaldi-compatible log mel filterbank of 16 kHz audio ``(1, N)`` -> float32 ``(T, n_mels)``.

    ``T = 1 + (N - 400) // 160`` frames of 25 ms every 10 ms (no edge padding). Per frame: remove
    the mean, pre-emphasis 0.97 (the first sample against itself), Povey window (non-periodic
    Hann to the power 0.85), zero-pad to 512, power spectrum, 80 Kaldi mel bins from 20 Hz to
    Nyquist, natural log floored at float32 eps. No dither, no energy term.
    """
    x = wav16[0]
    if x.shape[0] < KALDI_FRAME:
        raise InputError(f"audio too short for a filterbank frame: {x.shape[0]} samples < {KALDI_FRAME}")
    frames = x.unfold(0, KALDI_FRAME, KALDI_SHIFT)  # (T, 400)
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - KALDI_PREEMPH * previous
    frames = frames * torch.hann_window(KALDI_FRAME, periodic=False).pow(KALDI_POVEY_POWER)
    frames = F.pad(frames, (0, KALDI_N_FFT - KALDI_FRAME))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    energies = power @ _kaldi_mel_banks(n_mels, KALDI_N_FFT, TOKENIZER_SAMPLE_RATE, KALDI_LOW_HZ).T
    return torch.clamp(energies, min=FLOAT32_EPS).log()


def mel_spectrogram(wav: torch.Tensor, feat: FeatConfig) -> torch.Tensor:
    """The flow-prompt mel (Matcha ``mel_spectrogram``) of ``(1, N)`` audio at ``feat.sampling_rate``.

    Reflect-pad ``(n_fft - hop) / 2`` samples on both sides, uncentered STFT with a periodic
    Hann window, magnitude ``sqrt(re² + im² + 1e-9)``, Slaney mel basis, natural log floored at
    1e-5. Returns float32 ``(1, num_mels, N // hop)`` for the official 1920/480 setting.
    """
    pad = int((feat.n_fft - feat.hop_size) / 2)
    if wav.shape[-1] <= pad:
        raise InputError(f"audio too short for the prompt mel: {wav.shape[-1]} samples, need more than {pad}")
    y = F.pad(wav.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(y, feat.n_fft, hop_length=feat.hop_size, win_length=feat.win_size,
                      window=torch.hann_window(feat.win_size), center=feat.center, pad_mode="reflect",
                      normalized=False, onesided=True, return_complex=True)
    spec = torch.view_as_real(spec)
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    basis = torch.from_numpy(slaney_mel_filterbank(feat.sampling_rate, feat.n_fft, feat.num_mels, feat.fmin, feat.fmax))
    return torch.log(torch.clamp(basis @ mag, min=1e-5))
