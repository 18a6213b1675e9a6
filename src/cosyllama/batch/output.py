"""The output directory of a batch: ``<id>.<format>`` files (audio, and captions where a row asks),
and ``results.jsonl``.

Audio and caption files are written under a temporary name (``.<id>.<format>.part``) and renamed, so a
file with its final name is always complete. ``results.jsonl`` gets one line per finished row, appended and
flushed as the row finishes; at the end of a run it is rewritten (atomically) with the latest line
of each row, in manifest order. A row counts as done when its latest line says ``ok``, it was made
from the same manifest row (``digest``), its file is on disk with the recorded size and its caption
files (``captions``) are on disk, and, when takes of it were caught (``retries``), it ran with the same
``--retries`` (``retries_allowed``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ..audio_out import FILE_FORMATS, write_file
from ..errors import InputError

FORMATS = FILE_FORMATS
RESULTS = "results.jsonl"
LOCK = ".cosyllama-batch.lock"
PART = ".part"


def part_name(row_id: str, fmt: str) -> str:
    return f".{row_id}.{fmt}{PART}"


def audio_name(row_id: str, fmt: str) -> str:
    return f"{row_id}.{fmt}"


def caption_name(row_id: str, fmt: str) -> str:
    return f"{row_id}.{fmt}"


def write_audio(out_dir: Path, row_id: str, samples: np.ndarray, sample_rate: int, fmt: str,
                publish: Callable[[Path, Path], bool] | None = None) -> int | None:
    """Write 16-bit mono audio atomically (the samples ``cosyllama synth`` writes; encoded by
    :func:`cosyllama.audio_out.write_file`); returns its size.

    ``publish(tmp, final)`` does the rename and says whether it did (default: always); when it
    declines, the temporary file is removed and the result is ``None``."""
    return _write_atomic(out_dir, audio_name(row_id, fmt), part_name(row_id, fmt),
                         lambda f: write_file(f, samples, sample_rate, fmt), publish)


def write_caption(out_dir: Path, row_id: str, text: str, fmt: str,
                  publish: Callable[[Path, Path], bool] | None = None) -> int | None:
    """Write a caption file (``text``, already in its format) atomically, as :func:`write_audio` writes audio."""
    data = text.encode("utf-8")
    return _write_atomic(out_dir, caption_name(row_id, fmt), part_name(row_id, fmt), lambda f: f.write(data),
                         publish)


def _write_atomic(out_dir: Path, name: str, tmp_name: str, write: Callable,
                  publish: Callable[[Path, Path], bool] | None) -> int | None:
    final, tmp = out_dir / name, out_dir / tmp_name
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if publish is None:
            os.replace(tmp, final)
        elif not publish(tmp, final):
            tmp.unlink(missing_ok=True)
            return None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final.stat().st_size


def prepare_out_dir(out: str | Path) -> Path:
    """Create the directory if needed and remove the temporary files of an interrupted run."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create output directory {str(out)!r}: {e}") from None
    for p in out.glob(f".*{PART}"):
        p.unlink(missing_ok=True)
    return out


class DirLock:
    """Keeps two batch runs from writing one directory at once (advisory ``flock``)."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / LOCK
        self._f = None

    def __enter__(self) -> DirLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return self
        self._f = open(self.path, "a")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            self._f = None
            raise InputError(f"another cosyllama batch is writing to {str(self.path.parent)!r}; "
                             "wait for it or use another --out") from None
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None:
            self._f.close()  # closing releases the lock
            self._f = None


def read_results(out_dir: Path) -> dict[str, dict]:
    """The latest result of each id in ``results.jsonl`` (a torn last line is ignored)."""
    path = out_dir / RESULTS
    latest: dict[str, dict] = {}
    if not path.exists():
        return latest
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                latest[rec["id"]] = rec
    return latest


def is_done(rec: dict | None, out_dir: Path, fmt: str, digest: str, captions: tuple[str, ...] = (),
            retries: int | None = None) -> bool:
    """An ok result for this very row whose file is on disk, whole, and so are its caption files (the formats
    ``captions``). ``retries``: this run's ``--retries``; a row that had takes caught under another is not done
    (what became of them depends on it), one whose takes all passed is the same whatever it is (None: not
    checked)."""
    if retries is not None and rec and rec.get("retries") and rec.get("retries_allowed") != retries:
        return False
    if not rec or rec.get("status") != "ok" or rec.get("digest") != digest or rec.get("file") != audio_name(
            rec["id"], fmt):
        return False
    names = [caption_name(rec["id"], c) for c in captions]
    if rec.get("captions", []) != names:
        return False
    try:
        return ((out_dir / rec["file"]).stat().st_size == rec.get("bytes")
                and all((out_dir / n).is_file() for n in names))
    except OSError:
        return False


class ResultsLog:
    """Appends result lines, each flushed to disk before the next row is counted."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / RESULTS
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def compact_results(out_dir: Path, order: Iterable[str | dict]) -> None:
    """Rewrite ``results.jsonl`` with the latest line of each id. ``order`` is the manifest's order:
    an id (its latest line goes there) or a record (a row without a usable id); ids no longer in
    the manifest follow at the end."""
    latest = read_results(out_dir)
    lines = []
    for item in order:
        if isinstance(item, dict):
            lines.append(item)
        elif item in latest:
            lines.append(latest.pop(item))
    lines.extend(latest.values())
    path = out_dir / RESULTS
    tmp = out_dir / ("." + RESULTS + PART)
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in lines:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
