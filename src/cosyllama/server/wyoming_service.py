"""What every connection of the Wyoming server shares (:mod:`cosyllama.server.wyoming`): :class:`WyomingService`,
over the :class:`~cosyllama.server.serving.Serving`: the synthesis options of every request (the protocol carries
none), the ``info`` that ``describe`` answers (the registered voices and ``default``, each in the languages
served), the voice a request asks for, and the rate-limited log of clients that break the protocol
(:class:`RateLimitedLog`). Needs the ``wyoming`` extra.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .. import __version__
from ..defaults import LANGUAGES
from ..errors import MissingDependencyError
from ..voices import UnknownVoiceError
from .client_json import clip
from .conn import ConnectionLimits
from .voice_names import DEFAULT_VOICE, VoiceNames
from .wyoming_wire import RequestRefused, event_caps

try:
    from wyoming.info import Attribution, Info, TtsProgram, TtsVoice
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the Wyoming server needs its extra: pip install 'cosyllama[wyoming]'") from e

log = logging.getLogger("cosyllama.wyoming")

MODEL_ATTRIBUTION = Attribution(name="FunAudioLLM (Fun-CosyVoice3-0.5B)", url="https://github.com/FunAudioLLM/CosyVoice")
VOICE_ATTRIBUTION = Attribution(name="a voice registered with this server", url="")
BAD_CLIENT_LINES = 10  # warnings about misbehaving clients per minute; the rest are counted




class WyomingService:
    """What every connection shares: the :class:`~cosyllama.server.serving.Serving` (its pipeline, gate,
    threads and options: the default voice, the synthesis options of every request, e.g. ``greedy``/``seed``,
    which the protocol cannot carry) and the rate-limited log of misbehaving clients."""

    def __init__(self, serving):
        self.serving, self.tts = serving, serving.tts
        self.names = VoiceNames.wyoming(serving.options.default_voice)  # how a request's voice name finds its voice
        self.languages = serving.options.languages or LANGUAGES  # what describe lists, the first one first
        # the server's defaults, all of them (the events carry no option); streamed, but at a speed other than 1
        # each sentence is synthesized whole, as a WebSocket stream at that speed is
        self.options = serving.options.request_options(streams=True)
        self.limits: ConnectionLimits = serving.options.connection_limits
        self.caps = event_caps(serving.limits)
        self.connections: dict[asyncio.Task, object] = {}  # each open connection's task and its codec
        self._warned = RateLimitedLog(BAD_CLIENT_LINES, 60.0)

    async def call(self, fn, *args):
        return await self.serving.call(fn, *args)

    def info(self) -> Info:
        """The ``info`` event's content (reads the voice store: run it in :meth:`call`)."""
        voices = self.tts.voices.items()
        entries = [TtsVoice(name=vid, description=f"{vid} (cloned from a {v.duration:.1f} s clip)",
                            attribution=VOICE_ATTRIBUTION, installed=True, version=None,
                            languages=list(self.languages))
                   for vid, v in sorted(voices.items())]
        if DEFAULT_VOICE not in voices:
            try:
                default = f"default ({self.names.voice_id(self.tts.voices, None)})"
            except UnknownVoiceError as e:
                default = f"default (none yet: {e})"
            entries.insert(0, TtsVoice(name=DEFAULT_VOICE, description=default, attribution=VOICE_ATTRIBUTION,
                                       installed=True, version=None, languages=list(self.languages)))
        program = TtsProgram(name="cosyllama", attribution=MODEL_ATTRIBUTION, installed=True, version=__version__,
                             description="CosyVoice3 text-to-speech with cloned voices (cosyllama)",
                             voices=entries, supports_synthesize_streaming=True)
        return Info(tts=[program])

    def voice(self, voice) -> tuple[str, object]:
        """The id and features of the voice a request asks for (a ``SynthesizeVoice`` or None: the default voice),
        found as every door finds one (:class:`~cosyllama.server.voice_names.VoiceNames`); reads the voice store:
        run it in :meth:`call`."""
        language = voice.language if voice is not None else None
        if language and language.replace("_", "-").split("-")[0].lower() not in self.languages:
            which = ("CosyVoice3 speaks; it speaks" if self.languages == LANGUAGES
                     else "this server speaks (--language); it speaks")
            raise RequestRefused(f"language {clip(language)} is not one {which} {', '.join(self.languages)}",
                                 "language_not_supported")
        return self.names.resolve(self.tts.voices, voice.name if voice is not None else None)

    def warn_bad_client(self, peer: str, why: str) -> None:
        """One warning line for a client that broke the protocol (:meth:`warn`)."""
        self.warn("Wyoming client %s broke the protocol: %s", peer, why)

    def warn(self, msg: str, *args) -> None:
        """A warning about a client, at most :data:`BAD_CLIENT_LINES` a minute (the rest are counted)."""
        self._warned(msg, *args)

class RateLimitedLog:
    """``log.warning`` at most ``n`` times per ``window`` seconds; the lines left out are counted
    and the count is logged with the next line let through."""

    def __init__(self, n: int, window: float):
        self.n, self.window = n, window
        self.start, self.count, self.dropped = time.monotonic(), 0, 0

    def __call__(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.start >= self.window:
            if self.dropped:
                log.warning("%d more such Wyoming clients were not logged", self.dropped)
            self.start, self.count, self.dropped = now, 0, 0
        if self.count < self.n:
            self.count += 1
            log.warning(msg, *args)
        else:
            self.dropped += 1


__all__ = ["BAD_CLIENT_LINES", "DEFAULT_VOICE", "RateLimitedLog", "WyomingService"]
