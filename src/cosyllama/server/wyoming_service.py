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
from dataclasses import replace

from .. import __version__
from ..defaults import LANGUAGES
from ..errors import MissingDependencyError
from ..request import check_options
from ..voices import describe_ids, show_id, unknown_voice
from .client_json import clip
from .conn import ConnectionLimits
from .wyoming_wire import RequestRefused, event_caps

try:
    from wyoming.info import Attribution, Info, TtsProgram, TtsVoice
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError("the Wyoming server needs its extra: pip install 'cosyllama[wyoming]'") from e

log = logging.getLogger("cosyllama.wyoming")

LISTED_BY = " (describe lists them)"  # where a Wyoming client finds every voice id
DEFAULT_VOICE = "default"  # the voice name that means "the server's default voice"
MODEL_ATTRIBUTION = Attribution(name="FunAudioLLM (Fun-CosyVoice3-0.5B)", url="https://github.com/FunAudioLLM/CosyVoice")
VOICE_ATTRIBUTION = Attribution(name="a voice registered with this server", url="")
BAD_CLIENT_LINES = 10  # warnings about misbehaving clients per minute; the rest are counted




class WyomingService:
    """What every connection shares: the :class:`~cosyllama.server.serving.Serving` (its pipeline, gate,
    threads and options: the default voice, the synthesis options of every request, e.g. ``greedy``/``seed``,
    which the protocol cannot carry) and the rate-limited log of misbehaving clients."""

    def __init__(self, serving):
        self.serving, self.tts = serving, serving.tts
        self.default_voice = serving.options.default_voice
        self.languages = serving.options.languages or LANGUAGES  # what describe lists, the first one first
        defaults = serving.options.defaults
        # streaming synthesis, but at a speed other than 1 (which stretches the finished audio) each sentence is
        # synthesized whole, as a WebSocket stream at that speed is
        self.options = replace(defaults, stream=defaults.speed == 1.0)
        check_options(self.options)
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
                default = f"default ({self._default_id(sorted(voices))})"
            except RequestRefused as e:
                default = f"default (none yet: {e})"
            entries.insert(0, TtsVoice(name=DEFAULT_VOICE, description=default, attribution=VOICE_ATTRIBUTION,
                                       installed=True, version=None, languages=list(self.languages)))
        program = TtsProgram(name="cosyllama", attribution=MODEL_ATTRIBUTION, installed=True, version=__version__,
                             description="CosyVoice3 text-to-speech with cloned voices (cosyllama)",
                             voices=entries, supports_synthesize_streaming=True)
        return Info(tts=[program])

    def _default_id(self, ids: list[str]) -> str:
        if self.default_voice is not None:
            if self.default_voice not in ids:
                raise RequestRefused(f"the default voice {show_id(self.default_voice)} is not registered; registered "
                                     f"voices: {describe_ids(ids, more=LISTED_BY)}", "voice_not_found")
            return self.default_voice
        if not ids:
            raise RequestRefused("no voice is registered; register one through the HTTP API (POST /v1/voices) "
                                 "or start with --voices DIR holding one", "voice_not_found")
        return ids[0]

    def voice(self, voice) -> tuple[str, object]:
        """The id and features of the voice a request asks for (a ``SynthesizeVoice`` or None);
        reads the voice store: run it in :meth:`call`."""
        name = voice.name if voice is not None else None
        language = voice.language if voice is not None else None
        if language and language.replace("_", "-").split("-")[0].lower() not in self.languages:
            which = ("CosyVoice3 speaks; it speaks" if self.languages == LANGUAGES
                     else "this server speaks (--language); it speaks")
            raise RequestRefused(f"language {clip(language)} is not one {which} {', '.join(self.languages)}",
                                 "language_not_supported")
        ids = sorted(self.tts.voices.ids())
        if name is None or (name == DEFAULT_VOICE and name not in ids):
            name = self._default_id(ids)
        elif name not in ids:
            raise self._unknown(name, ids)
        try:
            return name, self.tts.voices.get(name)
        except Exception as e:  # e.g. its file went bad: the client learns no path, the log has it
            log.warning("voice %s cannot be read: %s", name, e)
            raise self._unknown(name, ids) from e

    @staticmethod
    def _unknown(name: str, ids: list[str]) -> RequestRefused:
        return RequestRefused(unknown_voice(name, [DEFAULT_VOICE, *ids], more=LISTED_BY), "voice_not_found")

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


__all__ = ["BAD_CLIENT_LINES", "DEFAULT_VOICE", "LISTED_BY", "RateLimitedLog", "WyomingService"]
