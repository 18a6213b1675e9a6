"""Vocoder stage: causal HiFT (see docs/reference.md#vocoder). 80-band log-mel at 50 frames/s -> 24 kHz waveform.

mel -> f0 (float64 conv predictor) -> harmonic sine source -> source STFT; mel -> conv_pre ->
3 x (nearest upsample + causal conv, add the down-sampled source, average of 3 Snake resblocks)
-> conv_post -> magnitude/phase -> iSTFT -> clamp. Every conv is causal except the two
look-ahead convs (f0 ``condnet.0``: 3 frames, ``conv_pre``: 4 frames), which is what makes
streaming by "re-run on the whole mel, emit only the new samples" exact (see
docs/reference.md#vocoder-streaming).

Speed: :meth:`HiFT.decode` runs the conv stack channels-last (``fast``: :class:`FastGenerator`; same
math as the module-by-module :meth:`HiFT.decode_reference`, up to float rounding). For streaming,
:meth:`HiFT.stream_step` (``stream``) gives the samples of that re-run scheme while computing only
the new frames plus the decoder's receptive field (:func:`decoder_history_frames`).

Modules: ``modules`` (source noise and building blocks), ``fast`` (the channels-last stack),
``stream`` (incremental vocoding), ``hift`` (:class:`HiFT`). Module attribute names equal the keys
of ``hift.pt`` after weight-norm folding (:func:`cosyllama.weights.load_hift_weights`).
"""

from .hift import HiFT
from .modules import (
    F0_HISTORY,
    F0_LOOKAHEAD,
    NOISE_SAMPLES,
    F0Predictor,
    ResBlock,
    Snake,
    SourceModule,
    replay_source_rng,
    source_noise,
    source_noise_state,
)
from .stream import VocoderStream, decoder_history_frames

__all__ = ["F0_HISTORY", "F0_LOOKAHEAD", "NOISE_SAMPLES", "F0Predictor", "HiFT", "ResBlock", "Snake",
           "SourceModule", "VocoderStream", "decoder_history_frames", "replay_source_rng", "source_noise",
           "source_noise_state"]
