"""Registered voices: prompt features computed once, reused by id, kept in memory or in a file; what a voice
id may be and the one "unknown voice" message.

A voice file is ``torch.save`` of ``{"format": "cosyllama-voices", "version": 1, "voices": {id: {...}}}``
with tensors, strings and int lists only, so it loads with ``weights_only=True`` (no code runs).
:meth:`VoiceStore.save` writes every voice of a store into one such file (a bundle);
:class:`~cosyllama.voice_directory.VoiceDirectory` keeps one file per voice, ``<id>.pt``, in a directory
several processes share, and voice folders. Either is what ``--voices`` takes (``batch`` reads every
``*.pt`` file of a directory, ``serve`` keeps a directory as its store).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
from pathlib import Path

import torch

from .errors import InputError
from .frontend import PromptFeatures

FORMAT = "cosyllama-voices"
VERSION = 1
SUFFIX = ".pt"  # a voice directory's files: <id>.pt
TEMP_SUFFIX = ".tmp"  # files being written: .<id>.<random>.tmp (ids never start with '.')
STALE_TEMP_S = 3600  # a temporary file this old was left by a process that died while writing
VOICE_ID_RE = re.compile(r"^(?!\.)[A-Za-z0-9_.-]{1,64}$")  # no leading '.': not '.', '..' or a hidden file
NAMED_IDS = 5  # ids an "unknown voice" message names; the rest are counted
SHOWN_ID_CHARS = 64  # characters of a client's id a message echoes (the longest valid id)
SKIP_REASON_CHARS = 200  # a skipped file's reason, one line


def show_id(voice_id) -> str:
    """A client's voice id (or any string of its: a Wyoming event type, a length) as a message echoes
    it: quoted, at most :data:`SHOWN_ID_CHARS` characters of it, and its length when it was longer (a
    message must not grow with the request)."""
    if not isinstance(voice_id, str):
        return f"of type {type(voice_id).__name__}"
    if len(voice_id) <= SHOWN_ID_CHARS:
        return repr(voice_id)
    return f"{voice_id[:SHOWN_ID_CHARS]!r}... ({len(voice_id)} characters)"


def describe_ids(ids: list[str], n: int = NAMED_IDS, more: str = "") -> str:
    """``ids`` for a message: the first ``n``, then how many more (a message must not grow with the
    store) followed by ``more`` (where the client finds them all), or ``none``."""
    if not ids:
        return "none"
    head = ", ".join(ids[:n])
    return head if len(ids) <= n else f"{head} and {len(ids) - n} more{more}"


def unknown_voice(voice_id, ids: list[str], more: str = "") -> str:
    """The one "unknown voice" message of the HTTP server, the Wyoming server and the Python API:
    the id clipped (:func:`show_id`), then the first :data:`NAMED_IDS` of ``ids`` and how many
    more (``more``: where to find them all, e.g. " (GET /v1/voices lists them)")."""
    return f"unknown voice {show_id(voice_id)}; registered voices: {describe_ids(ids, more=more)}"


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not VOICE_ID_RE.match(voice_id):
        raise InputError(f"voice id {show_id(voice_id)} is not allowed; use 1-64 letters, digits, '_', '-' or '.', "
                         "not starting with '.'")
    return voice_id


class UnknownVoiceError(InputError):
    """No voice of that id is registered (or its file or folder cannot be read: see
    :attr:`VoiceStore.skipped`)."""


class VoiceExistsError(InputError):
    """A voice of that id is registered and replacing it was not asked for."""


class ReadOnlyVoicesError(InputError):
    """The store does not take new voices or removals (``VoiceStore.read_only``), or the id is a
    voice folder (changed through its files only)."""


def voice_payload(voices: dict[str, PromptFeatures], **extra) -> dict:
    return {"format": FORMAT, "version": VERSION, **extra, "voices": {
        vid: {"speech_tokens": v.speech_tokens, "speaker_embedding": v.speaker_embedding,
              "prompt_feat": v.prompt_feat, "prompt_text": v.prompt_text,
              "prompt_text_ids": list(v.prompt_text_ids), "token_rate": v.token_rate,
              **({"instruction": v.instruction} if v.instruction is not None else {})}
        for vid, v in voices.items()}}


def one_line(text: str, limit: int = SKIP_REASON_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_payload(path: Path, label: str | None = None) -> dict:
    """The checked top level of a voice file; :class:`InputError` starting with ``label`` (default:
    the path) when it is none."""
    at = f"{path if label is None else label}: " if label != "" else ""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputError(f"voice file {str(path)!r} does not exist" if label is None else f"{at}does not exist") \
            from None
    except Exception as e:
        raise InputError(f"{at}not a voice file ({type(e).__name__}: {one_line(e)})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"{at}not a cosyllama voice file")
    if data.get("version") != VERSION:
        raise InputError(f"{at}voice file version {data.get('version')} is not supported (need {VERSION})")
    if not isinstance(data.get("voices"), dict):
        raise InputError(f"{at}not a cosyllama voice file (no voices)")
    return data


def voices_of(data: dict, label: str = "") -> dict[str, PromptFeatures]:
    at = f"{label}: " if label else ""
    out = {}
    for vid, d in data["voices"].items():
        try:
            instruction = d.get("instruction")
            out[vid] = PromptFeatures(
                speech_tokens=d["speech_tokens"].to(torch.int32), speaker_embedding=d["speaker_embedding"].float(),
                prompt_feat=d["prompt_feat"].float(), prompt_text=d["prompt_text"],
                prompt_text_ids=tuple(int(x) for x in d["prompt_text_ids"]),
                **({"token_rate": int(d["token_rate"])} if "token_rate" in d else {}),
                instruction=instruction if isinstance(instruction, str) else None)
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise InputError(f"{at}voice {vid!r} is incomplete ({type(e).__name__}: {one_line(e)})") from e
    return out


def read_voice_file(path: str | Path) -> dict[str, PromptFeatures]:
    """The voices of a file written by :meth:`VoiceStore.save` or a
    :class:`~cosyllama.voice_directory.VoiceDirectory`, by id."""
    path = Path(path)
    return voices_of(read_payload(path), str(path))


def write_durably(directory: Path, name: str, data: dict) -> Path:
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


def fsync_dir(directory: Path) -> None:
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
            raise UnknownVoiceError(unknown_voice(voice_id, known))
        return voice

    def remove(self, voice_id: str) -> None:
        self._check_writable()
        with self._lock:
            if self._voices.pop(voice_id, None) is None:
                raise UnknownVoiceError(f"unknown voice {show_id(voice_id)}")

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._voices)

    @property
    def skipped(self) -> dict[str, str]:
        """Voice files that could not be read, with the reason (none in memory; see
        :class:`~cosyllama.voice_directory.VoiceDirectory`)."""
        return {}

    def set_encoder(self, encoder) -> None:
        """How voice folders become voices (a :class:`~cosyllama.voice_directory.ClipEncoder`; only a
        :class:`~cosyllama.voice_directory.VoiceDirectory` has folders)."""

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
        tmp = write_durably(path.parent, path.name, voice_payload(self.items()))
        os.replace(tmp, path)  # never leave a half-written file behind

    def load(self, path: str | Path) -> list[str]:
        """Add the voices of a file written by :meth:`save`; returns their ids."""
        loaded = []
        for vid, voice in read_voice_file(path).items():
            self._put(vid, voice, True)
            loaded.append(vid)
        return loaded


__all__ = ["FORMAT", "NAMED_IDS", "SHOWN_ID_CHARS", "STALE_TEMP_S", "SUFFIX", "TEMP_SUFFIX", "VERSION", "VOICE_ID_RE",
           "ReadOnlyVoicesError", "UnknownVoiceError", "VoiceExistsError", "VoiceStore", "check_voice_id",
           "describe_ids", "fsync_dir", "one_line", "read_payload", "read_voice_file", "show_id", "unknown_voice",
           "voice_payload", "voices_of", "write_durably"]
