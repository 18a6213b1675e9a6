"""The start-up both servers share, without fastapi: ``cosyllama serve`` (:func:`cosyllama.server.app.serve`)
and ``cosyllama wyoming`` (:func:`cosyllama.server.wyoming_server.run_wyoming`) take typed options
(:class:`~cosyllama.server.options.ServingOptions`, and for HTTP
:class:`~cosyllama.server.options.ServeOptions`), checked when they are made, and both go through
:func:`start` and :func:`ready`:

1. :func:`cosyllama.memory.bound_onednn_cache` (once per process start, before torch computes anything);
2. the addresses to listen at are checked (:func:`check_can_listen`: a taken port is one line, not a
   traceback after the load);
3. the voice store of ``--voices`` is opened (:func:`open_voice_store`);
4. the models are loaded and the CPU line logged (:func:`load_models`);
5. (the server prepares its :class:`~cosyllama.server.serving.Serving`: :func:`~cosyllama.server.serving.prepare`)
6. :func:`ready`: the voices are warmed and the llama.cpp OpenMP hint is logged.

The commands turn their flags into these options (:mod:`cosyllama.commands.options`); nothing here
sees the command line. They also set where cosyllama's log lines go (:func:`configure_logging`, ``--log-level``);
a server says where it listens, with what, in one line (:func:`log_start`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from ..defaults import LOG_LEVEL, LOG_LEVELS
from ..errors import InputError
from ..options import LoadOptions
from ..voice_directory import VoiceDirectory
from ..voices import VoiceStore, describe_ids
from .options import ServeOptions, ServingOptions

log = logging.getLogger("cosyllama.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Lines to ``sys.stderr`` as it is when each is written (a redirected or captured stream too)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # logging.StreamHandler sets it; the stream is always sys.stderr's
        pass


def configure_logging(level: str = LOG_LEVEL) -> None:
    """Send cosyllama's log lines from ``level`` (one of :data:`LOG_LEVELS`) up to stderr, one line each
    (``serve`` and ``wyoming``; a library user configures logging their own way). Without it only warnings
    reach stderr (Python's last-resort handler), so an operator saw no INFO line: no refusal, cut or timeout.
    Called again, it changes the level and keeps one handler."""
    if level not in LOG_LEVELS:
        raise InputError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    logger = logging.getLogger("cosyllama")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)


def log_start(load: LoadOptions, voices: VoiceStore, where: str) -> None:
    """The start-up line: where the server listens, the model and LLM it serves (``load``), how many voices."""
    from .. import __version__

    llm = f"GGUF {load.gguf} on llama.cpp" if load.gguf is not None else f"{load.llm or 'torch'} LLM"
    log.info("cosyllama %s listening on %s: model %s (%s), %d voices", __version__, where, load.model_dir, llm,
             len(voices))


def start(options: ServingOptions, check_addresses: Callable[[], None] = lambda: None):
    """Steps 1-4 of the start-up (see the module docstring): the loaded
    :class:`~cosyllama.models.Models` and the voice store they serve. ``check_addresses`` raises
    :class:`~cosyllama.errors.InputError` when the server cannot listen where it is asked to."""
    from .. import memory

    memory.bound_onednn_cache()  # effective when torch has not computed anything yet (cosyllama.memory)
    check_addresses()
    voices = open_voice_store(options.voices)
    models = load_models(options.load)
    return models, voices


def ready(serving) -> None:
    """Step 6, once the :class:`~cosyllama.server.serving.Serving` is prepared (voice folders are made into
    voices by then): warm every voice beside the first requests, and log the llama.cpp OpenMP hint where
    it applies."""
    warm_voices(serving.tts, low_latency=serving.options.warm_low_latency)
    openmp_hint(serving.models.llm)


def load_models(options: LoadOptions):
    """The :class:`~cosyllama.models.Models` a server loads from ``options`` (checked when they were made,
    before the minutes of loading); the CPU line (the path that runs, and why) is logged after."""
    from ..cpu import tts_path
    from ..models import Models

    models = Models.load(options)
    for line in tts_path(models, options.precision, options.threads).lines():
        log.warning("%s", line)  # the CPU line, as synth and demo print it (start-up facts go out at warning)
    return models


def openmp_hint(llm) -> None:
    """Log, once at start, when the llama.cpp build threads with OpenMP (slower beside flow work)."""
    if llm.name == "llamacpp":
        from ..llm.llamacpp_backend import openmp_serving_hint

        hint = openmp_serving_hint()
        if hint:
            log.warning("%s", hint)


def check_can_listen(host: str, port: int, where: str) -> None:
    """An :class:`InputError` naming ``where`` when this process cannot listen at ``host``:``port``
    (taken, or not an address of this machine), found before a model is loaded; port 0 always can."""
    import socket

    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's and uvicorn's servers do
            s.bind(address)
    except OSError as e:
        raise InputError(f"cannot listen at {where}: {e.strerror or e}") from None


def open_voice_store(path: str | None) -> VoiceStore:
    """The voice store ``--voices PATH`` asks for, read and checked (before the model loads, so a
    bad one is reported at once):

    * a directory (made when missing): a :class:`~cosyllama.voice_directory.VoiceDirectory`; voices
      registered or deleted over HTTP are kept there and seen by every server sharing it; voice
      folders (``NAME/ref.wav`` and ``ref.txt`` or ``instruct.txt``) are made into voices by
      :func:`prepare`; a file or folder that cannot be read is skipped with a warning (it is no
      voice; ``/health`` counts it), so one bad file does not keep every replica down;
    * a voice file (:meth:`VoiceStore.save`): its voices, read-only (POST and DELETE get 403);
    * None: an empty store in memory; registered voices last until the server stops.

    :func:`prepare` says what was found (:func:`report_voices`).
    """
    if path is None:
        return VoiceStore()
    if Path(path).is_file():
        store = VoiceStore()
        store.load(path)
        store.read_only = True
        return store
    if Path(path).suffix == ".pt":
        raise InputError(f"voice file {path!r} does not exist (a directory to keep voices in needs a name "
                         "without the .pt suffix)")
    return VoiceDirectory(path)


def report_voices(store: VoiceStore) -> None:
    """The start-up line of the voices (:func:`prepare` logs it): how many are served (skipped
    files are none of them) and which files were skipped (the store logged each with its reason;
    the log is the operator's, ``/health`` says only how many without the API key)."""
    n = len(store)
    if isinstance(store, VoiceDirectory):
        skipped = store.skipped  # each was logged with its path and reason when it was found
        log.warning("voices: %d in the directory %s, where registrations are kept%s", n, store.directory,
                    f"; {len(skipped)} skipped: {describe_ids(list(skipped))}" if skipped else "")
    elif store.read_only:
        log.warning("voices: %d from a read-only voice file", n)
    else:
        log.warning("voices: %d, kept in memory only (registered voices are lost when the server stops; "
                    "--voices DIR keeps them)", n)


def warm_voices(tts, voices: VoiceStore | None = None, low_latency: bool = False) -> None:
    """Warm every voice of ``voices`` (default: ``tts.voices``) on ``tts``'s models in a background
    thread, beside the first requests (each voice's first stream gets a head start; ``low_latency``:
    the server's streams start with the low-latency first chunk, see TTS.warm_voice)."""
    voices = tts.voices if voices is None else voices
    if len(voices):
        threading.Thread(target=_warm_all, args=(tts, voices, low_latency), name="cosyllama-warm-voices",
                         daemon=True).start()


def _warm_all(tts, voices: VoiceStore, low_latency: bool) -> None:
    drops = tts.token2wav.prompt_drops
    for vid in voices.ids():
        try:
            tts.warm_voice(voices.get(vid), low_latency)
        except Exception as e:
            log.warning("warming voice %s failed: %s", vid, e)
    dropped = tts.token2wav.prompt_drops - drops
    if dropped:  # the bound let voices push out others (or one was too big to keep)
        held = tts.token2wav.prompt_cache_info()
        log.warning("the prompt cache's bound let %d warmed voice(s) go, holding %d (%.0f MiB): a stream with "
                    "one of those solves its prompt again before its first chunk; --prompt-cache-mb sets the bound",
                    dropped, held["prompts"], held["bytes"] / 2**20)


__all__ = ["LOG_LEVELS", "ServeOptions", "ServingOptions", "check_can_listen", "configure_logging", "load_models",
           "log_start", "open_voice_store", "openmp_hint", "ready", "report_voices", "start", "warm_voices"]
