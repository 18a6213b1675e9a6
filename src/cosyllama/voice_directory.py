"""Voices shared on disk: :class:`VoiceDirectory`, one voice file per voice in a directory several processes
share, and voice folders (``<id>/ref.wav`` with ``ref.txt`` or ``instruct.txt``, the layout wyoming-piper's
cloning voices use) made into voices by a :class:`ClipEncoder` and kept beside their clip as ``voice.pt``.
What cannot be read is skipped with its reason; nothing is read or written through a link that leads out of
the directory. The voice file format and the in-memory store are :mod:`cosyllama.voices`'.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path

from .errors import InputError
from .frontend import PromptFeatures
from .text.normalize import text_problem
from .voices import (
    STALE_TEMP_S,
    SUFFIX,
    TEMP_SUFFIX,
    VOICE_ID_RE,
    ReadOnlyVoicesError,
    UnknownVoiceError,
    VoiceExistsError,
    VoiceStore,
    check_voice_id,
    fsync_dir,
    one_line,
    read_payload,
    show_id,
    unknown_voice,
    voice_payload,
    voices_of,
    write_durably,
)

# a voice folder <id>/ of a voice directory: the clip, its transcript or a style instruction, and the
# voice made from them, kept beside them
REF_WAV, REF_TXT, INSTRUCT_TXT, FOLDER_VOICE = "ref.wav", "ref.txt", "instruct.txt", "voice.pt"
LEXICON_TXT = "lexicon.txt"  # a voice folder's pronunciation lexicon (docs/pronunciation.md), optional
MAX_FOLDER_TEXT_BYTES = 64 * 1024  # ref.txt / instruct.txt read at most this much (the limits check the rest)

log = logging.getLogger("cosyllama.voices")  # the voices' one log, whichever module writes it


@dataclass(frozen=True)
class ClipEncoder:
    """How a voice folder's clip becomes a voice: ``make(audio, transcript) -> PromptFeatures``
    (``audio``: the bytes of ``ref.wav``; e.g. :meth:`cosyllama.TTS.make_voice`), and ``key``: a
    string that differs whenever ``make`` would give other features (another model), so that a
    folder's kept voice made by another model is made again."""

    make: Callable[[bytes, str | None], PromptFeatures]
    key: str
    # the text tokenizer a folder's lexicon.txt is checked against (None: CosyVoice3's token lists only)
    tokenizer: object = None

    @classmethod
    def of(cls, tts) -> ClipEncoder:
        """The encoder of a :class:`cosyllama.TTS` (with its limits, when it has them)."""
        return cls(tts.make_voice, model_voice_key(tts.config), tts.frontend.tokenizer)


def model_voice_key(config) -> str:
    """What the voice of a clip depends on in a model directory, as a short string: the rates, the
    mel settings, and the two prompt encoders and the text tokenizer's files (by name, size and
    modification time, so a model directory is not read whole to tell)."""
    from .prompt import SPEAKER_ENCODER_FILE, SPEECH_TOKENIZER_FILE

    h = hashlib.sha256(repr((config.sample_rate, config.token_frame_rate, config.feat)).encode())
    files = [config.model_dir / SPEECH_TOKENIZER_FILE, config.model_dir / SPEAKER_ENCODER_FILE]
    with contextlib.suppress(OSError):
        files += sorted(p for p in config.qwen_dir.iterdir() if p.suffix in (".json", ".txt"))
    for f in files:
        try:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        except OSError:
            h.update(f"{f.name}:-;".encode())
    return h.hexdigest()[:32]


MAX_FOLDER_WAV_BYTES = 64 * 1024 * 1024  # a folder's ref.wav (30 s of 48 kHz stereo float is 11.5 MB)


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputError(f"{what} is larger than {limit // 1024} KiB")
    return data


def _read_text(path: Path) -> str | None:
    """A voice folder's text file, whitespace collapsed; None when it is missing or blank. Its text
    follows the rules of a request's text fields (:func:`~cosyllama.text.normalize.text_problem`: no
    control characters but tab and newline), checked before whitespace is collapsed; the character
    limits are checked where the text is used (the transcript when the voice is made, the
    instruction with each request), as a request's are."""
    if not path.is_file():
        return None
    data = _read_bounded(path, MAX_FOLDER_TEXT_BYTES, path.name)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(f"{path.name} is not UTF-8 text") from None
    problem = text_problem(text)
    if problem is not None:
        raise InputError(f"{path.name} {problem}")
    return " ".join(text.split()) or None


def _is_within(path: Path, root: Path) -> bool:
    """Whether ``path``, its links followed, is ``root`` (its links followed) or inside it."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def check_within(path: Path, root: Path, what: str) -> None:
    """:class:`InputError` when ``path`` is a link (or inside a linked folder) that leads outside
    ``root``, the voice directory: a voice directory's files are never read or written through a
    link out of it (a link that stays inside it is followed). ``what`` names it in the message,
    which names no path."""
    if not _is_within(path, root):
        raise InputError(f"{what} is a link to outside the voice directory; links are followed only within it")


class _NoEncoder(Exception):
    """A voice folder met before the store has a :class:`ClipEncoder`: neither a voice nor skipped yet."""


def is_voice_folder(path: Path) -> bool:
    """Whether ``path`` is a folder named as a voice id holding a ``ref.wav``."""
    return bool(VOICE_ID_RE.match(path.name)) and (path / REF_WAV).is_file()


def read_voice_folder(folder: str | Path, encoder: ClipEncoder | None, *, lock: threading.Lock | None = None,
                      on_unkept: Callable[[OSError], None] | None = None,
                      root: str | Path | None = None) -> PromptFeatures:
    """The voice of a voice folder: ``ref.wav``, with ``ref.txt`` (its transcript) or
    ``instruct.txt`` (a style instruction, kept as :attr:`PromptFeatures.instruction`), both
    optional, and ``lexicon.txt`` (words the voice speaks as pronunciation tokens, checked against
    :attr:`ClipEncoder.tokenizer`, kept as :attr:`PromptFeatures.lexicon`; read each time, not part
    of the kept voice), optional. Made by ``encoder`` once and kept in the folder as ``voice.pt``, keyed on the bytes of
    the three files and :attr:`ClipEncoder.key`; read from there while they are the same (``lock``:
    held while one is made, so two threads make it once). ``on_unkept``: called when ``voice.pt``
    cannot be written (a read-only folder: the voice is made each time). ``root``: the voice
    directory (default: the folder's parent); a folder, or a file of it, that is a link leading
    outside it is refused (:func:`check_within`), so nothing is read or written through such a link.
    :class:`InputError` names the file at fault, without the folder's path; ``encoder`` None raises
    :class:`_NoEncoder`."""
    folder = Path(folder)
    root = folder.parent if root is None else Path(root)
    check_within(folder, root, "the folder")
    for name in (REF_WAV, REF_TXT, INSTRUCT_TXT, LEXICON_TXT, FOLDER_VOICE):
        if os.path.lexists(folder / name):
            check_within(folder / name, root, name)
    if not (folder / REF_WAV).is_file():
        raise InputError(f"no {REF_WAV} in it (a voice folder holds {REF_WAV}, and {REF_TXT} with its "
                         f"transcript or {INSTRUCT_TXT} with a style instruction)")
    transcript, instruction = _read_text(folder / REF_TXT), _read_text(folder / INSTRUCT_TXT)
    if encoder is None:
        raise _NoEncoder
    lexicon = _read_lexicon(folder / LEXICON_TXT, encoder.tokenizer)
    audio = _read_bounded(folder / REF_WAV, MAX_FOLDER_WAV_BYTES, REF_WAV)
    h = hashlib.sha256(encoder.key.encode())
    for part in (audio, transcript, instruction):
        b = b"\x00" if part is None else b"\x01" + (part.encode() if isinstance(part, str) else part)
        h.update(len(b).to_bytes(8, "little") + b)
    source = h.hexdigest()
    kept = folder / FOLDER_VOICE
    with lock if lock is not None else contextlib.nullcontext():  # another thread's voice is kept when it looks
        with contextlib.suppress(InputError):
            data = read_payload(kept)
            if data.get("source") == source:
                voices = voices_of(data)
                if len(voices) == 1:
                    return _replace(next(iter(voices.values())), lexicon=lexicon)
        try:
            voice = encoder.make(audio, transcript)
        except InputError as e:
            raise InputError(f"{REF_WAV}: {e}" if "transcript" not in str(e) else f"{REF_TXT}: {e}") from None
        voice = _replace(voice, instruction=instruction)
        tmp = None
        try:
            tmp = write_durably(folder, FOLDER_VOICE, voice_payload({folder.name: voice}, source=source))
            os.replace(tmp, kept)
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if on_unkept is not None:
                on_unkept(e)
    return _replace(voice, lexicon=lexicon)


def _read_lexicon(path: Path, tokenizer):
    """A voice folder's ``lexicon.txt`` (:meth:`~cosyllama.text.lexicon.Lexicon.load`, its messages naming
    the file without the folder's path), or None when there is none or it holds no entry."""
    if not path.is_file():
        return None
    from .text.lexicon import Lexicon

    lexicon = Lexicon.load(path, tokenizer, name=LEXICON_TXT)
    return lexicon if len(lexicon) else None


class VoiceDirectory(VoiceStore):
    """Voices kept in ``directory``: one file per voice (``<id>.pt``, the format of
    :meth:`VoiceStore.save` holding that one voice), shared with every process that opens it, and
    voice folders (``<id>/ref.wav`` with ``ref.txt``, its transcript, or ``instruct.txt``, a style
    instruction; both optional; and ``lexicon.txt``, its pronunciation lexicon, optional), which people
    drop in.

    Writes are atomic and durable: a voice is written to a temporary file, synced, and renamed
    into place (the directory synced too), so a crash or ``kill -9`` leaves each voice either
    whole or absent, and a registration or removal that returned is on disk. Every lookup checks
    the voice's file or folder (a ``stat``) and reads it again when another process replaced it;
    a voice another process added is found on first lookup, one it removed is gone. ``add(...,
    replace=False)`` creates the file with a hard link, which fails if it exists, so two
    processes registering one id cannot both succeed. The directory is made when it does not
    exist (its parent must).

    A voice folder's voice is made once by the store's :class:`ClipEncoder` (:meth:`set_encoder`;
    until then folders are not listed) and kept beside the clip as ``<id>/voice.pt``, keyed on the
    contents of the clip and text files and on the model (:attr:`ClipEncoder.key`): changing one
    makes the voice again. Folders change through their files only: :meth:`add` and
    :meth:`remove` refuse a folder's id with :class:`ReadOnlyVoicesError`.

    A file or folder that cannot be read (truncated, empty, not a voice file, a clip that is no
    speech) is skipped with a warning naming it, so one bad file in a shared directory does not
    keep a server down: it is no voice (not in :meth:`ids`, a lookup gets
    :class:`UnknownVoiceError`), and :attr:`skipped` maps it to the reason until it is replaced
    (a changed file or folder is read again) or removed.
    """

    persistent = True

    def __init__(self, directory: str | Path, encoder: ClipEncoder | None = None):
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
        self._encoder = encoder
        self._encode_lock = threading.Lock()  # one folder's clip encoded at a time
        self._cache: dict[str, tuple[tuple, PromptFeatures]] = {}  # id -> ((kind, stamp), voice)
        self._skipped: dict[str, tuple[tuple, str]] = {}  # "<id>.pt" or "<id>/" -> (stamp, why)
        self._unkept: set[str] = set()  # folders whose voice.pt could not be written (warned once)
        self._remove_stale_temp_files()
        self.ids()  # every voice read at start: a bad one is reported now

    def set_encoder(self, encoder: ClipEncoder | None) -> None:
        """Make voice folders' voices with ``encoder`` from now on; the folders not made yet are
        made here (a folder's kept ``voice.pt`` of the same clip and model is read instead)."""
        self._encoder = encoder
        self.ids()

    @property
    def skipped(self) -> dict[str, str]:
        """What could not be read, by file (``<id>.pt``) or folder (``<id>/``) name, with the reason
        (one line, no paths; a snapshot; files removed since are left out)."""
        self.ids()
        with self._lock:
            return {name: why for name, (_, why) in sorted(self._skipped.items())}

    def folders(self) -> dict[str, bool]:
        """The voice folders holding a ``ref.wav`` (by id, with whether a ``ref.txt`` is there),
        read or not; what a caller without a model can know of them."""
        out = {}
        with os.scandir(self.directory) as it:
            for entry in it:
                if (VOICE_ID_RE.match(entry.name) and entry.is_dir() and (Path(entry.path) / REF_WAV).is_file()
                        and not self._path(entry.name).is_file() and _is_within(Path(entry.path), self.directory)):
                    out[entry.name] = (Path(entry.path) / REF_TXT).is_file()
        return dict(sorted(out.items()))

    def _path(self, voice_id: str) -> Path:
        return self.directory / (voice_id + SUFFIX)

    def _remove_stale_temp_files(self) -> None:
        now = time.time()
        for p in [*self.directory.glob(f".*{TEMP_SUFFIX}"), *self.directory.glob(f"*/.*{TEMP_SUFFIX}")]:
            with contextlib.suppress(OSError):  # another process may remove it first
                if now - p.stat().st_mtime > STALE_TEMP_S:
                    p.unlink()

    def _unknown(self, voice_id) -> UnknownVoiceError:
        return UnknownVoiceError(unknown_voice(voice_id, self.ids()))

    def _folder_refused(self, voice_id: str) -> ReadOnlyVoicesError:
        return ReadOnlyVoicesError(f"voice {voice_id!r} is a voice folder ({voice_id}/{REF_WAV}); it changes "
                                   "through its files only: replace or remove them in the voice directory")

    def _put(self, voice_id: str, voice: PromptFeatures, replace: bool) -> None:
        check_voice_id(voice_id)
        if (self.directory / voice_id).is_dir():
            raise self._folder_refused(voice_id)
        path = self._path(voice_id)
        tmp = write_durably(self.directory, voice_id, voice_payload({voice_id: voice}))
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
            fsync_dir(self.directory)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with contextlib.suppress(OSError):
            stamp = self._stamp(os.stat(path))
            with self._lock:
                self._cache[voice_id] = (("file", stamp), voice)
                self._skipped.pop(path.name, None)

    @staticmethod
    def _stamp(st: os.stat_result) -> tuple:
        return st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def _folder_stamp(self, folder: Path) -> tuple:
        out = []
        for name in (REF_WAV, REF_TXT, INSTRUCT_TXT, LEXICON_TXT):
            try:
                out.append(self._stamp(os.stat(folder / name)))
            except OSError:
                out.append(None)
        return tuple(out)

    def _source(self, voice_id: str) -> tuple[str, tuple] | None:
        """``("file" | "folder", stamp)`` of the voice's file or folder as it is now (a file wins
        over a folder of the same id); None when there is neither."""
        try:
            st = os.stat(self._path(voice_id))
            if stat.S_ISREG(st.st_mode):
                return "file", self._stamp(st)
        except OSError:
            pass
        folder = self.directory / voice_id
        if folder.is_dir():
            return "folder", self._folder_stamp(folder)
        return None

    def _load(self, voice_id) -> PromptFeatures | None:
        """The voice of ``voice_id`` (read again when its file or folder changed), or None: no such
        voice, one that cannot be read (recorded in :attr:`skipped`, warned once), or a folder
        before the store has an encoder."""
        if not isinstance(voice_id, str) or not VOICE_ID_RE.match(voice_id):
            return None
        src = self._source(voice_id)
        if src is None:
            with self._lock:
                self._cache.pop(voice_id, None)
            return None
        kind, stamp = src
        name = voice_id + (SUFFIX if kind == "file" else "/")
        with self._lock:
            cached = self._cache.get(voice_id)
            if cached is not None and cached[0] == src:
                return cached[1]
            known_bad = self._skipped.get(name)
            if known_bad is not None and known_bad[0] == stamp:
                return None
        try:
            voice = self._read_file(voice_id) if kind == "file" else self._read_folder(voice_id)
        except _NoEncoder:
            return None
        except Exception as e:  # a bad file, a clip that is no speech; or the encoder's own failure
            if self._source(voice_id) is None:  # removed meanwhile
                return None
            why = one_line(str(e) if isinstance(e, InputError) else f"cannot be made ({type(e).__name__})")
            log.warning("voices: skipped, not served: %s: %s", self.directory / name, why,
                        exc_info=None if isinstance(e, InputError) else e)
            with self._lock:
                self._skipped[name] = (stamp, why)
                self._cache.pop(voice_id, None)
            return None
        with self._lock:
            self._cache[voice_id] = (src, voice)
            self._skipped.pop(name, None)
        return voice

    def _read_file(self, voice_id: str) -> PromptFeatures:
        check_within(self._path(voice_id), self.directory, "the file")
        voices = voices_of(read_payload(self._path(voice_id), ""))  # the reason, apart from the name
        if list(voices) != [voice_id]:
            raise InputError(f"holds the voice(s) {', '.join(map(repr, voices)) or 'none'}; a voice directory holds "
                             f"one voice per file, named <id>{SUFFIX} (copy a bundle's voices in with "
                             "VoiceDirectory(dir).load(file))")
        return voices[voice_id]

    def _read_folder(self, voice_id: str) -> PromptFeatures:
        def unkept(e: OSError) -> None:
            if voice_id not in self._unkept:
                self._unkept.add(voice_id)
                log.warning("voices: cannot keep the voice of %s (%s); it is made again at each start",
                            self.directory / voice_id, e)

        return read_voice_folder(self.directory / voice_id, self._encoder, lock=self._encode_lock, on_unkept=unkept,
                                 root=self.directory)

    def get(self, voice_id: str) -> PromptFeatures:
        voice = self._load(voice_id)
        if voice is None:
            raise self._unknown(voice_id)
        return voice

    def remove(self, voice_id: str) -> None:
        self._check_writable()
        src = self._source(voice_id) if isinstance(voice_id, str) and VOICE_ID_RE.match(voice_id) else None
        if src is None:
            raise UnknownVoiceError(f"unknown voice {show_id(voice_id)}")
        if src[0] == "folder":
            raise self._folder_refused(voice_id)
        try:
            os.unlink(self._path(voice_id))
        except FileNotFoundError:
            raise UnknownVoiceError(f"unknown voice {show_id(voice_id)}") from None
        finally:
            with self._lock:
                self._cache.pop(voice_id, None)
        fsync_dir(self.directory)

    def _entries(self) -> list[str]:
        """Every id of a voice file or folder in the directory, readable or not."""
        files, folders = set(), set()
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(SUFFIX) and VOICE_ID_RE.match(entry.name[:-len(SUFFIX)]) and entry.is_file():
                    files.add(entry.name[:-len(SUFFIX)])
                elif VOICE_ID_RE.match(entry.name) and entry.is_dir():
                    folders.add(entry.name)
        names = {v + SUFFIX for v in files} | {v + "/" for v in folders}
        with self._lock:  # forget the voices other processes removed
            for gone in set(self._cache) - files - folders:
                del self._cache[gone]
            for gone in set(self._skipped) - names:
                del self._skipped[gone]
            for both in files & folders:  # the file is the voice; the folder is reported
                self._skipped[both + "/"] = ((), f"the voice file {both}{SUFFIX} has the same id; rename one")
        return sorted(files | (folders - files))

    def ids(self) -> list[str]:
        """The ids of the voices that can be served (files and folders read, skipped ones left out)."""
        return [vid for vid in self._entries() if self._load(vid) is not None]

    def __contains__(self, voice_id: str) -> bool:
        return self._load(voice_id) is not None


__all__ = ["FOLDER_VOICE", "INSTRUCT_TXT", "LEXICON_TXT", "MAX_FOLDER_WAV_BYTES", "REF_TXT", "REF_WAV", "ClipEncoder",
           "VoiceDirectory", "check_within", "is_voice_folder", "model_voice_key", "read_voice_folder"]
