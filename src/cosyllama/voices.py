"""Registered voices: prompt features computed once, reused by id, kept in memory, in a file or in
a directory.

A voice file is ``torch.save`` of ``{"format": "cosyllama-voices", "version": 1, "voices": {id: {...}}}``
with tensors, strings and int lists only, so it loads with ``weights_only=True`` (no code runs).
:meth:`VoiceStore.save` writes every voice of a store into one such file (a bundle);
:class:`VoiceDirectory` keeps one file per voice, ``<id>.pt``, in a directory, written atomically,
and reads the directory again when asked, so several processes can share it. Either is what
``--voices`` takes (``batch`` reads every ``*.pt`` file of a directory, ``serve`` keeps a directory
as its store).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import torch

from .errors import InputError
from .frontend import PromptFeatures

FORMAT = "cosyllama-voices"
VERSION = 1
SUFFIX = ".pt"  # a voice directory's files: <id>.pt
TEMP_SUFFIX = ".tmp"  # files being written: .<id>.<random>.tmp (ids never start with '.')
STALE_TEMP_S = 3600  # a temporary file this old was left by a process that died while writing
_ID_RE = re.compile(r"^(?!\.)[A-Za-z0-9_.-]{1,64}$")  # no leading '.': not '.', '..' or a hidden file
NAMED_IDS = 5  # ids an "unknown voice" message names; the rest are counted

log = logging.getLogger("cosyllama.voices")


def describe_ids(ids: list[str], n: int = NAMED_IDS, listed_by: str = "GET /v1/voices") -> str:
    """``ids`` for a message: the first ``n``, then how many more and what lists them all
    (``listed_by``: a message must not grow with the store), or ``none``."""
    if not ids:
        return "none"
    head = ", ".join(ids[:n])
    return head if len(ids) <= n else f"{head} and {len(ids) - n} more ({listed_by} lists them)"


def unknown_voice(voice_id, ids: list[str]) -> str:
    return f"unknown voice {voice_id!r}; registered voices: {describe_ids(ids)}"


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not _ID_RE.match(voice_id):
        raise InputError(f"voice id {voice_id!r} is not allowed; use 1-64 letters, digits, '_', '-' or '.', "
                         "not starting with '.'")
    return voice_id


class VoiceExistsError(InputError):
    """A voice of that id is registered and replacing it was not asked for."""


class ReadOnlyVoicesError(InputError):
    """The store does not take new voices or removals (``VoiceStore.read_only``)."""


def _payload(voices: dict[str, PromptFeatures]) -> dict:
    return {"format": FORMAT, "version": VERSION, "voices": {
        vid: {"speech_tokens": v.speech_tokens, "speaker_embedding": v.speaker_embedding,
              "prompt_feat": v.prompt_feat, "prompt_text": v.prompt_text,
              "prompt_text_ids": list(v.prompt_text_ids), "token_rate": v.token_rate}
        for vid, v in voices.items()}}


def read_voice_file(path: str | Path) -> dict[str, PromptFeatures]:
    """The voices of a file written by :meth:`VoiceStore.save` or :class:`VoiceDirectory`, by id."""
    path = Path(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"voice file {str(path)!r} does not exist") from None
    except Exception as e:
        raise InputError(f"{path}: not a voice file ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"{path}: not a cosyllama voice file")
    if data.get("version") != VERSION:
        raise InputError(f"{path}: voice file version {data.get('version')} is not supported (need {VERSION})")
    out = {}
    for vid, d in data["voices"].items():
        try:
            out[vid] = PromptFeatures(
                speech_tokens=d["speech_tokens"].to(torch.int32), speaker_embedding=d["speaker_embedding"].float(),
                prompt_feat=d["prompt_feat"].float(), prompt_text=d["prompt_text"],
                prompt_text_ids=tuple(int(x) for x in d["prompt_text_ids"]),
                **({"token_rate": int(d["token_rate"])} if "token_rate" in d else {}))
        except (KeyError, AttributeError, TypeError) as e:
            raise InputError(f"{path}: voice {vid!r} is incomplete ({e})") from e
    return out


def _write_durably(directory: Path, name: str, data: dict) -> Path:
    """``data`` saved into a new temporary file of ``directory``, on disk (fsync) when this returns."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _fsync_dir(directory: Path) -> None:
    """Make a rename or removal in ``directory`` durable (not possible on every platform)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class VoiceStore:
    """A thread-safe id -> :class:`PromptFeatures` map, in memory.

    ``read_only``: when set, :meth:`add` and :meth:`remove` raise :class:`ReadOnlyVoicesError`
    (:meth:`load` still adds: it is how a read-only store is filled).
    """

    persistent = False  # whether added voices outlive the process

    def __init__(self):
        self._voices: dict[str, PromptFeatures] = {}
        self._lock = threading.Lock()
        self.read_only = False

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyVoicesError("this voice store is read-only")

    def add(self, voice_id: str, voice: PromptFeatures, *, replace: bool = True) -> None:
        """Register ``voice``; an existing id is replaced, or with ``replace=False`` refused with
        :class:`VoiceExistsError`."""
        self._check_writable()
        self._put(voice_id, voice, replace)

    def _put(self, voice_id: str, voice: PromptFeatures, replace: bool) -> None:
        check_voice_id(voice_id)
        with self._lock:
            if not replace and voice_id in self._voices:
                raise VoiceExistsError(f"voice {voice_id!r} exists")
            self._voices[voice_id] = voice

    def get(self, voice_id: str) -> PromptFeatures:
        with self._lock:
            voice = self._voices.get(voice_id)
            known = sorted(self._voices)
        if voice is None:
            raise InputError(unknown_voice(voice_id, known))
        return voice

    def remove(self, voice_id: str) -> None:
        self._check_writable()
        with self._lock:
            if self._voices.pop(voice_id, None) is None:
                raise InputError(f"unknown voice {voice_id!r}")

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    @property
    def skipped(self) -> dict[str, str]:
        """Voice files that could not be read, with the reason (none in memory; see
        :class:`VoiceDirectory`)."""
        return {}

    def __contains__(self, voice_id: str) -> bool:
        with self._lock:
            return voice_id in self._voices

    def __len__(self) -> int:
        return len(self.ids())

    def items(self) -> dict[str, PromptFeatures]:
        """Every voice, by id (a snapshot)."""
        out = {}
        for vid in self.ids():
            with contextlib.suppress(InputError):  # removed meanwhile
                out[vid] = self.get(vid)
        return out

    def save(self, path: str | Path) -> None:
        """Write every voice into one file (a bundle), replacing it atomically."""
        path = Path(path)
        tmp = _write_durably(path.parent, path.name, _payload(self.items()))
        os.replace(tmp, path)  # never leave a half-written file behind

    def load(self, path: str | Path) -> list[str]:
        """Add the voices of a file written by :meth:`save`; returns their ids."""
        loaded = []
        for vid, voice in read_voice_file(path).items():
            self._put(vid, voice, True)
            loaded.append(vid)
        return loaded


class VoiceDirectory(VoiceStore):
    """Voices kept in ``directory``, one file per voice (``<id>.pt``, the format of
    :meth:`VoiceStore.save` holding that one voice), shared with every process that opens it.

    Writes are atomic and durable: a voice is written to a temporary file, synced, and renamed
    into place (the directory synced too), so a crash or ``kill -9`` leaves each voice either
    whole or absent, and a registration or removal that returned is on disk. Every lookup checks
    the voice's file (one ``stat``) and reads it again when another process replaced it; a voice
    another process added is found on first lookup, one it removed is gone. ``add(...,
    replace=False)`` creates the file with a hard link, which fails if it exists, so two
    processes registering one id cannot both succeed. The directory is made when it does not
    exist (its parent must). At start every voice file is read: one that cannot be (truncated,
    empty, not a voice file) is skipped with a warning naming it, so one bad file in a shared
    directory does not keep a server down; :attr:`skipped` maps each such file to the reason, also
    for files found unreadable on a later lookup (a file read again since leaves it).
    """

    persistent = True

    def __init__(self, directory: str | Path):
        super().__init__()
        d = Path(directory)
        if not d.is_dir():
            if d.exists():
                raise InputError(f"voice directory {str(d)!r} is a file; give a directory "
                                 "(a voice file is loaded with VoiceStore.load)")
            if not d.parent.is_dir():
                raise InputError(f"cannot make voice directory {str(d)!r}: {str(d.parent)!r} does not exist")
            d.mkdir(exist_ok=True)
        self.directory = d
        self._cache: dict[str, tuple[tuple, PromptFeatures]] = {}  # id -> (file stamp, voice)
        self._skipped: dict[str, str] = {}  # file name -> why it could not be read
        self._remove_stale_temp_files()
        for vid in self.ids():
            try:
                self.get(vid)
            except InputError as e:
                log.warning("voices: skipped, not served: %s", e)

    @property
    def skipped(self) -> dict[str, str]:
        """Voice files that could not be read, by file name, with the reason (a snapshot; files
        removed since are left out)."""
        with self._lock:
            out = dict(self._skipped)
        return {name: why for name, why in out.items() if (self.directory / name).is_file()}

    def _path(self, voice_id: str) -> Path:
        return self.directory / (voice_id + SUFFIX)

    def _remove_stale_temp_files(self) -> None:
        now = time.time()
        for p in self.directory.glob(f".*{TEMP_SUFFIX}"):
            with contextlib.suppress(OSError):  # another process may remove it first
                if now - p.stat().st_mtime > STALE_TEMP_S:
                    p.unlink()

    def _unknown(self, voice_id: str) -> InputError:
        return InputError(unknown_voice(voice_id, self.ids()))

    def _put(self, voice_id: str, voice: PromptFeatures, replace: bool) -> None:
        check_voice_id(voice_id)
        path = self._path(voice_id)
        tmp = _write_durably(self.directory, voice_id, _payload({voice_id: voice}))
        try:
            if replace:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError:
                    raise VoiceExistsError(f"voice {voice_id!r} exists") from None
                except OSError:  # a filesystem without hard links: check, then rename
                    if path.exists():
                        raise VoiceExistsError(f"voice {voice_id!r} exists") from None
                    os.replace(tmp, path)
            _fsync_dir(self.directory)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with contextlib.suppress(OSError):
            stamp = self._stamp(os.stat(path))
            with self._lock:
                self._cache[voice_id] = (stamp, voice)

    @staticmethod
    def _stamp(st: os.stat_result) -> tuple:
        return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def get(self, voice_id: str) -> PromptFeatures:
        if not isinstance(voice_id, str) or not _ID_RE.match(voice_id):
            raise self._unknown(voice_id)
        path = self._path(voice_id)
        try:
            stamp = self._stamp(os.stat(path))
        except OSError:
            with self._lock:
                self._cache.pop(voice_id, None)
            raise self._unknown(voice_id) from None
        with self._lock:
            cached = self._cache.get(voice_id)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            voices = read_voice_file(path)
            if list(voices) != [voice_id]:
                raise InputError(f"{path}: holds the voice(s) {', '.join(map(repr, voices)) or 'none'}; a voice "
                                 f"directory holds one voice per file, named <id>{SUFFIX} (copy a bundle's voices "
                                 "in with VoiceDirectory(dir).load(file))")
        except InputError as e:
            if not path.exists():  # removed between the stat and the read
                raise self._unknown(voice_id) from None
            with self._lock:
                self._skipped[path.name] = str(e)
            raise
        with self._lock:
            self._cache[voice_id] = (stamp, voices[voice_id])
            self._skipped.pop(path.name, None)
        return voices[voice_id]

    def remove(self, voice_id: str) -> None:
        self._check_writable()
        if not isinstance(voice_id, str) or not _ID_RE.match(voice_id):
            raise self._unknown(voice_id)
        try:
            os.unlink(self._path(voice_id))
        except FileNotFoundError:
            raise InputError(f"unknown voice {voice_id!r}") from None
        finally:
            with self._lock:
                self._cache.pop(voice_id, None)
        _fsync_dir(self.directory)

    def ids(self) -> list[str]:
        found = []
        with os.scandir(self.directory) as it:
            for entry in it:
                vid = entry.name[:-len(SUFFIX)]
                if entry.name.endswith(SUFFIX) and _ID_RE.match(vid) and entry.is_file():
                    found.append(vid)
        with self._lock:  # forget the voices other processes removed
            for gone in set(self._cache) - set(found):
                del self._cache[gone]
            for gone in set(self._skipped) - {v + SUFFIX for v in found}:
                del self._skipped[gone]
        return sorted(found)

    def __contains__(self, voice_id: str) -> bool:
        return isinstance(voice_id, str) and bool(_ID_RE.match(voice_id)) and self._path(voice_id).is_file()
