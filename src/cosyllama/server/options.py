"""The typed options of the servers (no dependencies): :class:`ServingOptions`, what ``serve`` and
``wyoming`` share and :func:`~cosyllama.server.serving.prepare` builds a
:class:`~cosyllama.server.serving.Serving` from; :class:`ServeOptions`, what only the HTTP server has
(:func:`~cosyllama.server.app.create_app`). The commands make them from their flags
(:mod:`cosyllama.commands.options`); each is checked when it is made, before a model is loaded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..defaults import INTERLEAVE_MODES, LANGUAGES, MAX_QUEUE, MAX_VOICES, PREFILL_CHUNK
from ..errors import InputError
from ..limits import RequestLimits
from ..options import LoadOptions
from ..request import SynthesisOptions, check_options
from .conn import ConnectionLimits

DEFAULT_MAX_PROMPT_BYTES = 10 * 1024 * 1024  # bytes of an uploaded prompt file (30 s of audio fits easily)


@dataclass(frozen=True)
class ServingOptions:
    """What ``serve`` and ``wyoming`` share: the model, the per-request bounds, the scheduler, the voices."""

    # the model to load (the commands size its LLM for serving: --parallel sequences of --max-seq-tokens)
    load: LoadOptions
    # the bounds of one request (characters, text tokens, LLM positions, a streamed session's text)
    limits: RequestLimits = field(default_factory=RequestLimits)
    # prompt positions the scheduler prefills between two decode steps of the other requests
    prefill_chunk: int = PREFILL_CHUNK
    # how LLM decoding pauses during flow work, one of defaults.INTERLEAVE_MODES; None: auto (by threads
    # and cores, see cosyllama.server.serving.prepare)
    interleave: str | None = None
    # requests that may wait for a running slot; more are refused as busy
    max_queue: int = MAX_QUEUE
    # --voices: a directory to keep voices in, a voice file served read-only, or None (in memory)
    voices: str | None = None
    # the registered voice a Wyoming request that names none speaks with (HTTP: OpenAI's voice names too)
    default_voice: str | None = None
    # --language: the languages Wyoming's describe lists for every voice, in order (Home Assistant offers the
    # voices for these); a request for another is refused; None: every language of defaults.LANGUAGES
    languages: tuple[str, ...] | None = None
    # what a client may hold open: header, body, write and idle timeouts, open connections
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    # requests synthesized at once; None: twice the scheduler's sequence slots (the LLM stays busy while
    # other requests are in the flow and vocoder)
    max_concurrent: int | None = None
    # what every request starts from (--seed, --greedy, --speed, --loudness, --retries): an HTTP or WebSocket
    # request overlays the fields it gives, a Wyoming request (whose events carry none) takes them all; see
    # request_options, the one place they meet
    defaults: SynthesisOptions = field(default_factory=SynthesisOptions)
    # --lexicon: words every request of every door speaks as pronunciation tokens (the served pipeline's
    # TTS.lexicon; a voice folder's lexicon.txt and a request's lexicon field add to it, winning); a
    # cosyllama.text.lexicon.Lexicon, checked against the model's vocabulary once it is loaded; None: none
    lexicon: Any = None

    def __post_init__(self):
        if self.lexicon is not None:
            from ..text.lexicon import Lexicon

            if not isinstance(self.lexicon, Lexicon):
                raise TypeError(f"lexicon must be a cosyllama.text.lexicon.Lexicon, got {type(self.lexicon).__name__}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise InputError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        # first_chunk_tokens is for the streamed requests: checked as a stream's (so a --speed, whose requests are
        # made whole, cannot go with it)
        check_options(replace(self.defaults, stream=self.defaults.first_chunk_tokens is not None))
        if self.prefill_chunk < 1:
            raise InputError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.interleave is not None and self.interleave not in INTERLEAVE_MODES:
            raise InputError(f"--interleave must be auto or one of {', '.join(INTERLEAVE_MODES)}, "
                             f"got {self.interleave!r}")
        if self.max_queue < 0:
            raise InputError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.languages is not None:
            bad = [x for x in self.languages if x not in LANGUAGES]
            if bad or not self.languages or len(set(self.languages)) != len(self.languages):
                raise InputError(f"--language takes each of {', '.join(LANGUAGES)} at most once, got "
                                 f"{', '.join(map(repr, self.languages)) or 'none'}")
        if self.default_voice is not None:
            from ..voices import check_voice_id

            check_voice_id(self.default_voice)

    @property
    def warm_low_latency(self) -> bool:
        """Whether voices are warmed for the low-latency first chunk (``TTS.warm_voice(low_latency=True)``): when
        streams start with one by default (``--first-chunk-tokens``)."""
        return bool(self.defaults.first_chunk_tokens)

    def request_options(self, given: Mapping[str, Any] | None = None, *, streams: bool) -> SynthesisOptions:
        """The options a request runs with, for every door: :attr:`defaults` overlaid by ``given`` (the fields of
        :class:`~cosyllama.request.SynthesisOptions` the client set; none for Wyoming), synthesized as a stream when
        the door sends the audio as it is made (``streams``) and the speed is 1 (the time stretch applies to the
        finished audio, so it is synthesized whole). What the client sent is not changed."""
        options = replace(self.defaults, **dict(given or {}))
        stream = streams and options.speed == 1.0
        # --first-chunk-tokens shapes streams only (a whole-file answer has one chunk)
        return replace(options, stream=stream, first_chunk_tokens=options.first_chunk_tokens if stream else None)


@dataclass(frozen=True)
class ServeOptions:
    """``cosyllama serve``: the shared options and what only the HTTP server has."""

    # the model, bounds, scheduler and voices (shared with `cosyllama wyoming`)
    serving: ServingOptions
    # where uvicorn listens
    host: str = "127.0.0.1"
    port: int = 8000
    # the Bearer key every request but GET /health must carry (--api-key, else $COSYLLAMA_API_KEY); None: none
    api_key: str | None = None
    # browser origins (scheme://host[:port], normalized) allowed to POST and DELETE, with CORS
    allow_origins: tuple[str, ...] = ()
    # registered voices; registering a new id past it gets 409; None: no bound
    max_voices: int | None = MAX_VOICES
    # a URI (tcp://HOST:PORT or unix://PATH) where the app also answers the Wyoming protocol; None: not
    wyoming: str | None = None
    # HTTP voice names -> registered voice ids (--voice-alias NAME=ID)
    voice_aliases: Mapping[str, str] = field(default_factory=dict)
    # bytes of an uploaded prompt file; larger ones get 413 (its length in seconds is the frontend's to check)
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES

    def __post_init__(self):
        if self.max_voices is not None and self.max_voices < 1:
            raise InputError(f"--max-voices must be >= 1, got {self.max_voices}")
        if self.max_prompt_bytes < 1:
            raise InputError(f"max_prompt_bytes must be >= 1, got {self.max_prompt_bytes}")


__all__ = ["DEFAULT_MAX_PROMPT_BYTES", "ServeOptions", "ServingOptions"]
