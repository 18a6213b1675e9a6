"""What one synthesis asks for: :class:`SynthesisRequest` (what to say, how, in which voice) and
:class:`SynthesisOptions` (the per-call knobs), and the one vocabulary of modes, :data:`MODES`.

Every front door (the Python API's mode methods, ``cosyllama synth``, the HTTP and WebSocket
routes, Wyoming, batch manifest rows, the upstream facade) builds a :class:`SynthesisRequest` and
hands it to :meth:`cosyllama.tts.TTS.run`.

Light on purpose (no torch): a door checks a request before any model work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("zero-shot", "cross-lingual", "instruct")  # the modes a text request chooses between


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-call options.

    stream: yield audio chunk by chunk as tokens are decoded. speed: 0.25-4.0 time stretch of the
    finished mel (non-streaming only). greedy: argmax decoding. seed: makes sampling reproducible
    (segment i uses seed + i). text_frontend: normalize and split the text. russian_numbers: spell
    numbers in Russian sentences in Russian (else English, as the reference does).
    max_tokens / ignore_stop: decoding overrides used by benchmarks.
    """

    stream: bool = False
    speed: float = 1.0
    greedy: bool = False
    seed: int | None = None
    text_frontend: bool = True
    russian_numbers: bool = True
    max_tokens: int | None = None
    ignore_stop: bool = False


@dataclass(frozen=True)
class SynthesisRequest:
    """One text synthesis: what to say, in which mode, in which voice, with which options.

    The voice is ``voice`` (a registered id, or a :class:`~cosyllama.frontend.PromptFeatures`) or
    ``prompt_wav`` (a clip) with its ``prompt_text`` (its transcript); ``mode`` None: chosen from
    what is given (see :meth:`cosyllama.tts.TTS.synthesize`)."""

    text: str
    mode: str | None = None
    voice: Any = None  # str (registered id) | PromptFeatures | None
    prompt_wav: Any = None  # AudioSource | None
    prompt_text: str | None = None
    instruction: str | None = None
    options: SynthesisOptions = SynthesisOptions()


__all__ = ["MODES", "SynthesisOptions", "SynthesisRequest"]
