"""The start-up both servers share, without fastapi: ``cosyllama serve`` (:func:`cosyllama.server.app.serve`)
and ``cosyllama wyoming`` (:func:`cosyllama.server.wyoming.run_wyoming`) take typed options
(:class:`ServingOptions`, and for HTTP :class:`ServeOptions`), checked when they are made, and both go
through :func:`start` and :func:`ready`:

1. :func:`cosyllama.memory.bound_onednn_cache` (once per process start, before torch computes anything);
2. the addresses to listen at are checked (a taken port is one line, not a traceback after the load);
3. the voice store of ``--voices`` is opened (:func:`~cosyllama.server.serving.open_voice_store`);
4. the TTS is loaded and the CPU line logged (:func:`~cosyllama.server.serving.load_tts`);
5. (the server prepares its served view: ``create_app`` or :func:`~cosyllama.server.serving.prepare`)
6. :func:`ready`: the voices are warmed and the llama.cpp OpenMP hint is logged.

The commands turn their flags into these options (:mod:`cosyllama.commands.options`); nothing here
sees the command line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..defaults import INTERLEAVE_MODES, MAX_QUEUE, MAX_VOICES, PREFILL_CHUNK
from ..errors import InputError
from ..limits import RequestLimits
from ..options import LoadOptions
from .conn import ConnectionLimits


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
    # what a client may hold open: header, body, write and idle timeouts, open connections
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)

    def __post_init__(self):
        if self.prefill_chunk < 1:
            raise InputError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.interleave is not None and self.interleave not in INTERLEAVE_MODES:
            raise InputError(f"--interleave must be auto or one of {', '.join(INTERLEAVE_MODES)}, "
                             f"got {self.interleave!r}")
        if self.max_queue < 0:
            raise InputError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.default_voice is not None:
            from ..voices import check_voice_id

            check_voice_id(self.default_voice)


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

    def __post_init__(self):
        if self.max_voices is not None and self.max_voices < 1:
            raise InputError(f"--max-voices must be >= 1, got {self.max_voices}")


def start(options: ServingOptions, check_addresses: Callable[[], None] = lambda: None):
    """Steps 1-4 of the start-up (see the module docstring): the loaded TTS and the voice store it serves.
    ``check_addresses`` raises :class:`~cosyllama.errors.InputError` when the server cannot listen
    where it is asked to."""
    from .. import memory
    from . import serving

    memory.bound_onednn_cache()  # effective when torch has not computed anything yet (cosyllama.memory)
    check_addresses()
    voices = serving.open_voice_store(options.voices)
    tts = serving.load_tts(options.load)
    return tts, voices


def ready(tts, voices) -> None:
    """Step 6, once the served view is prepared (voice folders are made into voices by then): warm every
    voice beside the first requests, and log the llama.cpp OpenMP hint where it applies."""
    from . import serving

    serving.warm_voices(tts, voices)
    serving.openmp_hint(tts)


__all__ = ["ServeOptions", "ServingOptions", "ready", "start"]
