"""Synthesis of manifest rows on one model: several rows at once, their LLM decode steps batched.

:class:`BatchEngine` loads a :class:`~cosyllama.tts.TTS`, builds its own pipeline over its models
with a :class:`~cosyllama.llm.scheduler.BatchScheduler` in front of the LLM (as the server does) and runs
``concurrency`` rows in worker threads: while some rows decode together, others run the flow and
the vocoder. Each finished row is written (atomically) to the output directory, with the caption files
it asks for (its segments, with word times where they align), and described by one result record. The
same engine runs inside each Ray actor (:mod:`cosyllama.batch.ray_runner`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..defaults import RETRIES
from ..errors import CosyllamaError, InputError
from ..openmp import release_thread_team
from ..options import LoadOptions
from .manifest import Row
from .output import audio_name, caption_name, write_audio, write_caption

log = logging.getLogger("cosyllama.batch")

DEFAULT_CONCURRENCY = 4
VOICE_CACHE = 128  # prompt clips whose features are kept (one per distinct prompt_wav + prompt_text)


@dataclass(frozen=True)
class EngineOptions:
    """What every engine (this process or a Ray actor) loads and runs; paths absolute, picklable.

    ``load``: the TTS (its ``parallel``: one LLM sequence per concurrent row). ``lexicon``: a
    :class:`~cosyllama.text.lexicon.Lexicon` every row speaks (``--lexicon``; a voice folder's and a row's add
    to it, their entries winning), checked against the model's vocabulary when the model is loaded."""

    load: LoadOptions
    voices: str | None = None  # a voice file (VoiceStore.save) or a directory of them
    concurrency: int = DEFAULT_CONCURRENCY
    fmt: str = "wav"
    flow_slots: int = 0  # rows in the flow + vocoder at once (0: no limit)
    lexicon: Any = None  # cosyllama.text.lexicon.Lexicon | None (pickled to Ray's actors with the rest)
    retries: int = RETRIES  # takes made again when one loops or runs away (--retries; docs/retries.md)


def voice_files(path: str | Path) -> list[Path]:
    """The voice files ``--voices`` names: the file itself, or a directory's ``*.pt`` files (its
    voice folders: :func:`voice_folders`)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.pt"))
        if not files and not voice_folders(p):
            raise InputError(f"--voices directory {str(p)!r} holds no voice files (*.pt) and no voice folders "
                             "(NAME/ref.wav)")
        return files
    if not p.is_file():
        raise InputError(f"--voices {str(p)!r} does not exist")
    return [p]


def voice_folders(path: str | Path) -> dict[str, Path]:
    """The voice folders of a ``--voices`` directory (``NAME/ref.wav``, see
    :func:`cosyllama.voice_directory.read_voice_folder`), by id; none for a file."""
    from ..voice_directory import is_voice_folder

    p = Path(path)
    if not p.is_dir():
        return {}
    return {f.name: f for f in sorted(p.iterdir()) if f.is_dir() and is_voice_folder(f)}


def load_voices(store, path: str | Path | None, encoder=None) -> None:
    """Register the voices of ``path`` (see :func:`voice_files`) in ``store``, and its voice folders'
    made with ``encoder`` (a :class:`~cosyllama.voice_directory.ClipEncoder`; kept in each folder): a folder
    that cannot be made into a voice is skipped with a warning, as ``serve`` skips it."""
    from ..voice_directory import read_voice_folder

    if path is None:
        return
    for f in voice_files(path):
        store.load(f)
    for vid, folder in voice_folders(path).items():
        if encoder is None or vid in store:
            continue
        try:
            store.add(vid, read_voice_folder(folder, encoder))
        except InputError as e:
            log.warning("voices: skipped, not served: %s/: %s", folder, e)


def load_models(opts: EngineOptions):
    """The :class:`~cosyllama.models.Models` an engine runs, and a voice store with the voices of ``opts.voices``."""
    from ..models import Models
    from ..tts import TTS
    from ..voice_directory import ClipEncoder
    from ..voices import VoiceStore

    models, voices = Models.load(opts.load), VoiceStore()
    load_voices(voices, opts.voices, ClipEncoder.of(TTS.from_models(models, voices=voices)))
    return models, voices


def load_tts(opts: EngineOptions):
    """A plain :class:`~cosyllama.tts.TTS` over :func:`load_models` (each call decodes alone), for scripts
    that compare a loop of calls with the engine."""
    from ..tts import TTS

    models, voices = load_models(opts)
    return TTS.from_models(models, voices=voices, lexicon=run_lexicon(opts, models))


def run_lexicon(opts: EngineOptions, models):
    """``opts.lexicon`` once its tokens are checked against the loaded model's vocabulary (LexiconError)."""
    return None if opts.lexicon is None else opts.lexicon.check(models.frontend.tokenizer)


def error_record(row_id: str | None, line: int, message: str, stage: str, digest: str | None = None) -> dict:
    rec = {"id": row_id, "line": line, "status": "error", "error": message, "stage": stage}
    if digest:
        rec["digest"] = digest
    return rec


def loudness_fields(target: float, t) -> dict:
    """What a row's loudness target did, from its synthesis' timings: the target, the one gain applied (dB),
    why that gain (target, ceiling, short, silent), the loudness it was measured at (None: too short or silent)
    and the samples held at the ceiling."""
    measured = t.loudness_measured
    return {"loudness": target, "loudness_gain_db": round(t.loudness_gain_db, 2), "loudness_why": t.loudness_why,
            "loudness_measured": None if measured is None else round(measured, 2), "loudness_held": t.loudness_held}


class RowSynthesizer:
    """Turns one row into its audio file and result record (thread-safe); ``retries``: the takes a text segment
    may be made again (``--retries``)."""

    def __init__(self, tts, out_dir: Path, fmt: str, retries: int = RETRIES):
        self.tts, self.out_dir, self.fmt, self.retries = tts, Path(out_dir), fmt, retries
        self._voices: OrderedDict[tuple[str, str | None], Future] = OrderedDict()
        self._lock = threading.Lock()
        # Set by abandon() when the run that owns the rows stops without waiting for them: a row still
        # running then publishes no file, since nobody would record it (a file on disk always has its
        # result line). The check and the rename happen under one lock, so none slips past abandon().
        self._abandoned = False
        self._publish_lock = threading.Lock()

    def _clip_voice(self, wav: str, text: str | None):
        """Features of a prompt clip, computed once for every row that uses the same clip and transcript."""
        key = (wav, text)
        with self._lock:
            fut = self._voices.get(key)
            mine = fut is None
            if mine:
                fut = self._voices[key] = Future()
                while len(self._voices) > VOICE_CACHE:
                    self._voices.popitem(last=False)
            else:
                self._voices.move_to_end(key)
        if mine:
            try:
                fut.set_result(self.tts.make_voice(wav, text))
            except BaseException as e:
                fut.set_exception(e)
        return fut.result()

    def _publish(self, tmp: Path, final: Path) -> bool:
        with self._publish_lock:
            if self._abandoned:
                return False
            os.replace(tmp, final)
            return True

    def abandon(self, row_ids: Iterable[str]) -> None:
        """Publish no more files, and remove those of ``row_ids`` (rows finished but not recorded)."""
        from ..captions import FORMATS as CAPTION_FORMATS

        with self._publish_lock:
            self._abandoned = True
        for row_id in row_ids:
            (self.out_dir / audio_name(row_id, self.fmt)).unlink(missing_ok=True)
            for fmt in CAPTION_FORMATS:
                (self.out_dir / caption_name(row_id, fmt)).unlink(missing_ok=True)

    def _write_captions(self, row: Row, segments) -> dict | None:
        """Write the row's caption files; the record's fields that list them and say whether they have word
        times (``words_why``: why not), or None when the run was abandoned meanwhile."""
        from ..captions import WRITERS

        for fmt in row.captions:
            if write_caption(self.out_dir, row.id, WRITERS[fmt](segments), fmt, self._publish) is None:
                return None
        rec = {"captions": [caption_name(row.id, fmt) for fmt in row.captions],
               "caption_level": "word" if segments and all(s.words is not None for s in segments) else "segment"}
        if rec["caption_level"] == "segment":
            rec["words_why"] = sorted({s.words_why for s in segments if s.words is None and s.words_why})
        return rec

    def run(self, row: Row, cancel=None) -> dict | None:
        """Synthesize and write one row; its result record (``None``: cancelled before the end)."""
        from ..llm.scheduler import CancelToken, RequestCancelled
        from ..request import SynthesisRequest

        cancel = cancel or CancelToken()
        t0 = time.perf_counter()
        try:
            cancel.check()  # a row cancelled before it started makes no voice
            voice = row.voice if row.voice is not None else self._clip_voice(row.prompt_wav, row.prompt_text)
            voice_s = time.perf_counter() - t0
            options = row.options(self.tts.frontend.tokenizer if row.lexicon else None, self.retries)
            syn = self.tts.run(SynthesisRequest(row.text, row.mode, voice=voice, instruction=row.instructions,
                                                options=options), cancel=cancel)
            audio = syn.audio()
            t1 = time.perf_counter()
            nbytes = write_audio(self.out_dir, row.id, audio, self.tts.sample_rate, self.fmt, self._publish)
            if nbytes is None:
                return None
            captions = self._write_captions(row, syn.segments) if row.captions else {}
            if captions is None:
                return None
            t2 = time.perf_counter()
        except RequestCancelled:
            return None
        except CosyllamaError as e:
            return error_record(row.id, row.line, str(e), "synthesis", row.digest)
        except Exception as e:  # one row's failure must not stop the batch
            return error_record(row.id, row.line, f"internal error: {type(e).__name__}: {e}", "synthesis", row.digest)
        t = syn.timings
        # word times are aligned while the synthesis waits between segments: its own stage, not flow_vocoder's
        seconds = {"frontend": round(voice_s + t.frontend, 4), "llm": round(t.llm, 4),
                   "flow_vocoder": round(t.token2wav - (t.align if row.captions else 0.0), 4),
                   "write": round(t2 - t1, 4), "total": round(t2 - t0, 4)}
        if row.captions:
            seconds["align"] = round(t.align, 4)
        return {"id": row.id, "line": row.line, "status": "ok", "error": None, "file": audio_name(row.id, self.fmt),
                "bytes": nbytes, "audio_seconds": round(audio.size / self.tts.sample_rate, 4),
                "tokens": sum(len(x) for x in t.tokens), "seconds": seconds, **captions,
                **(loudness_fields(row.loudness, t) if row.loudness is not None else {}),
                **(self._bad_takes(t.retries) if t.retries else {}), "digest": row.digest}

    def _bad_takes(self, caught) -> dict:
        """A row's caught takes (docs/retries.md), each as the HTTP door's ``retries`` list has it, and the
        ``--retries`` they were caught under (a run with another makes the row again)."""
        return {"retries": [b.as_dict() for b in caught], "retries_allowed": self.retries}


_STOP = object()


class _CtrlC:
    """Ctrl-C seen as a flag while rows run, so the interrupt never lands between taking a row's
    result and recording it (a row lost that way would be waited for forever). Only where the
    signal reaches Python as KeyboardInterrupt today (main thread, the default handler): a SIGINT
    that the shell ignores (a job started in the background) stays ignored."""

    def __init__(self) -> None:
        self.seen = False
        self._previous = None

    def __enter__(self) -> _CtrlC:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.seen = True

    def second_quits(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def __exit__(self, *exc) -> None:
        self.second_quits()


class BatchEngine:
    """Runs rows ``concurrency`` at a time on one TTS; decode steps of concurrent rows are batched.

    ``run`` returns when every row has a record, or raises ``KeyboardInterrupt`` after cancelling
    the rows in flight (their LLM sequences stop at once; on Ctrl-C a row already past its LLM
    finishes and is recorded; a KeyboardInterrupt raised by other code, e.g. in ``on_result``, waits
    for none and lets none of them write its file). Worker threads are daemons, so a second interrupt
    quits without waiting.
    """

    def __init__(self, opts: EngineOptions, out_dir: Path, models=None, voices=None):
        from ..llm.factory import make_token_source
        from ..tts import TTS
        from ..voices import VoiceStore

        self.opts = opts
        if models is None:  # given models (and voices) are shared and left as they are
            models, voices = load_models(opts)
        lexicon = run_lexicon(opts, models)
        # this engine's own scheduler (closed by close()): the rows' decode steps batched together
        self.scheduler = make_token_source(models.llm, batched=True, max_active=opts.concurrency)
        # the rows' pipeline: the models and voices, batched decoding, at most flow_slots rows in the flow
        self.tts = TTS.from_models(models, token_source=self.scheduler, voices=voices if voices is not None
                                   else VoiceStore(), flow_slots=opts.flow_slots, lexicon=lexicon)
        self.synth = RowSynthesizer(self.tts, out_dir, opts.fmt, opts.retries)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"cosyllama-batch-{i}", daemon=True)
                         for i in range(opts.concurrency)]
        for th in self._threads:
            th.start()
        release_thread_team()  # the rows run on the workers: this thread's OpenMP team would slow them

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            row, token = job
            try:
                rec = self.synth.run(row, token)
            except BaseException as e:  # pragma: no cover - run() already turns errors into records
                rec = error_record(row.id, row.line, f"internal error: {type(e).__name__}: {e}", "synthesis")
            self._done.put((row, rec))

    def run(self, rows: Iterable[Row], on_result: Callable[[dict], None],
            on_interrupt: Callable[[int], None] | None = None) -> None:
        from ..llm.scheduler import CancelToken

        it = iter(rows)
        in_flight: dict[str, CancelToken] = {}  # row id -> its cancel token
        more = True
        with _CtrlC() as ctrl_c:
            try:
                while not ctrl_c.seen:
                    while more and len(in_flight) < self.opts.concurrency:
                        row = next(it, None)
                        if row is None:
                            more = False
                            break
                        token = CancelToken()
                        in_flight[row.id] = token
                        self._jobs.put((row, token))
                    if not in_flight:
                        return
                    self._take_one(in_flight, on_result)
            except KeyboardInterrupt:  # raised by another handler: stop the rows, wait for none,
                for token in in_flight.values():  # and leave no file that nobody records
                    token.cancel()
                self.synth.abandon(in_flight)
                raise
            if on_interrupt is not None:
                on_interrupt(len(in_flight))
            for token in in_flight.values():
                token.cancel()
            ctrl_c.second_quits()  # the daemon workers are then left behind
            while in_flight:
                self._take_one(in_flight, on_result)
        raise KeyboardInterrupt

    def _take_one(self, in_flight: dict, on_result: Callable[[dict], None]) -> None:
        try:
            row, rec = self._done.get(timeout=0.25)  # short waits: Ctrl-C is seen at once
        except queue.Empty:
            return
        del in_flight[row.id]
        if rec is not None:
            on_result(rec)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(_STOP)
        for th in self._threads:
            th.join()
        self.scheduler.close()
