"""Even loudness (``SynthesisOptions.loudness``): one gain that brings a synthesis to an integrated loudness
target (ITU-R BS.1770, measured by :mod:`pyloudnorm`, the ``loudness`` extra), never past a true-peak ceiling.

* Non-streamed synthesis is measured whole and scaled by one gain: ``min(gain to the target, gain that puts
  the true peak at the ceiling)``.
* A stream's gain is fixed before its first chunk leaves, the same factor for every chunk, so nothing pumps:
  from the loudness of the voice's last finished output; before any, from the stream's own first sentence,
  held back until it is whole (the voice's prompt as the model's vocoder renders it when that sentence is too
  short to measure: :meth:`Token2Wav.prompt_level <cosyllama.engine.Token2Wav.prompt_level>`). What that
  does not foretell (a louder peak later) is held at the ceiling sample by sample.
* Audio whose loudness BS.1770 cannot give (shorter than its 400 ms gating block, or silent: -inf LUFS) keeps
  its level (gain 1), brought down only to the ceiling.

The true peak is the peak of the signal oversampled 4 times (BS.1770-4 Annex 2's method; scipy's polyphase
resampler as the interpolator), so the ceiling also holds between samples, where a DAC or a lossy encoder puts
them. See docs/loudness.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import MissingDependencyError
from .request import LOUDNESS_RANGE  # LUFS targets taken: BS.1770's absolute gate up to louder than any master

CEILING_DBFS = -1.0  # true-peak ceiling: no sample (nor inter-sample peak) of normalized audio goes above it
BLOCK_SECONDS = 0.4  # BS.1770's gating block: shorter audio has no integrated loudness
OVERSAMPLE = 4  # true-peak oversampling (BS.1770-4 Annex 2)
INSTALL_HINT = "--loudness needs pyloudnorm: pip install 'cosyllama[loudness]' (or pip install pyloudnorm)"


def require() -> None:
    """Raise :class:`MissingDependencyError` with the install hint unless pyloudnorm can be imported."""
    _pyloudnorm()


def _pyloudnorm():
    try:
        import pyloudnorm
    except ImportError:
        raise MissingDependencyError(INSTALL_HINT) from None
    return pyloudnorm


def db(gain: float) -> float:
    """A linear gain in dB (-inf for 0)."""
    return 20.0 * math.log10(gain) if gain > 0 else -math.inf


def integrated_loudness(samples: np.ndarray, sample_rate: int) -> float | None:
    """BS.1770 integrated loudness of mono ``samples`` in LUFS; -inf when silent (every block gated out); None
    when shorter than one 400 ms gating block."""
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    if x.size < math.ceil(BLOCK_SECONDS * sample_rate) + 1:
        return None
    meter = _pyloudnorm().Meter(sample_rate)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = float(meter.integrated_loudness(x))
    return value if math.isfinite(value) else -math.inf


def true_peak(samples: np.ndarray) -> float:
    """The linear true peak of ``samples``: the peak of the signal oversampled :data:`OVERSAMPLE` times (never
    below the sample peak); 0 for no samples."""
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    if x.size == 0:
        return 0.0
    peak = float(np.max(np.abs(x)))
    if x.size > 1:
        from scipy.signal import resample_poly

        peak = max(peak, float(np.max(np.abs(resample_poly(x, OVERSAMPLE, 1)))))
    return peak


@dataclass(frozen=True)
class Level:
    """What was measured: ``lufs`` (None: shorter than a gating block; -inf: silent) and the linear true ``peak``."""

    lufs: float | None
    peak: float

    @classmethod
    def of(cls, samples: np.ndarray, sample_rate: int) -> Level:
        return cls(integrated_loudness(samples, sample_rate), true_peak(samples))


@dataclass(frozen=True)
class Gain:
    """The one gain of a synthesis: ``factor`` (linear), ``db``, and ``why``: ``"target"`` (brings the
    loudness to the target), ``"ceiling"`` (less, so the peak stays at the ceiling), ``"short"`` or
    ``"silent"`` (no loudness to measure: 1, or less to meet the ceiling)."""

    factor: float
    db: float
    why: str


def gain_for(level: Level, target: float, ceiling_dbfs: float = CEILING_DBFS) -> Gain:
    """The gain that brings ``level`` to ``target`` LUFS, lowered where needed so its true peak stays at or
    below ``ceiling_dbfs``. Always finite: unmeasurable loudness gets gain 1 (or what the ceiling allows)."""
    ceiling = 10.0 ** (ceiling_dbfs / 20.0)
    to_ceiling = ceiling / level.peak if level.peak > 0 else math.inf
    if level.lufs is None or level.lufs == -math.inf:
        why = "short" if level.lufs is None else "silent"
        factor = min(1.0, to_ceiling)
        return Gain(factor, db(factor), why if factor == 1.0 else "ceiling")
    to_target = 10.0 ** ((target - level.lufs) / 20.0)
    factor = min(to_target, to_ceiling)
    if not math.isfinite(factor) or factor <= 0:  # a peak so small the ratio overflows: stay as it is
        factor = 1.0
    return Gain(factor, db(factor), "target" if factor == to_target else "ceiling")


def apply(samples: np.ndarray, factor: float, ceiling_dbfs: float = CEILING_DBFS) -> tuple[np.ndarray, int]:
    """``samples`` scaled by ``factor`` (float32), each sample held within the ceiling; returns the samples
    and how many had to be held (0 whenever the gain was computed from these samples' own peak)."""
    ceiling = np.float32(10.0 ** (ceiling_dbfs / 20.0))
    out = np.asarray(samples, dtype=np.float32) * np.float32(factor)
    over = np.abs(out) > ceiling
    n = int(np.count_nonzero(over))
    if n:
        np.clip(out, -ceiling, ceiling, out=out)
    return out, n


__all__ = ["BLOCK_SECONDS", "CEILING_DBFS", "Gain", "INSTALL_HINT", "LOUDNESS_RANGE", "Level", "OVERSAMPLE", "apply",
           "db", "gain_for", "integrated_loudness", "require", "true_peak"]
