"""Exceptions for user-facing problems. Each message names the bad value and what is allowed.

They subclass the builtin types callers already expect (``ValueError``, ``FileNotFoundError``), so
``except ValueError`` keeps working; the CLI maps every :class:`CosyllamaError` to exit code 2.
"""

from __future__ import annotations


class CosyllamaError(Exception):
    """Base class of every error caused by the user's input, files or options."""


class ModelDirError(CosyllamaError, FileNotFoundError):
    """A model directory is missing files or holds a file that does not fit the model."""


class CheckpointError(CosyllamaError, ValueError):
    """A weights file has missing, unexpected or mis-shaped tensors."""


class InputError(CosyllamaError, ValueError):
    """Bad text, audio or option given to a synthesis."""


class DeviceError(CosyllamaError, ValueError):
    """A device that is not available here was asked for."""


class MissingDependencyError(CosyllamaError, ImportError):
    """An optional extra is needed for the requested feature."""


class BackendBusyError(CosyllamaError, RuntimeError):
    """Every sequence slot (or the KV memory) of an LLM backend is in use; retry later."""


def read_user_text(path, what: str, directory_hint: str = "") -> str:
    """The text of a file the user named (``what``: how the message names it, e.g. ``--script 'a.txt'``), read as
    UTF-8; a missing file, a directory, other bytes or an unreadable file is an :class:`InputError` in one line
    (``directory_hint``: what to give instead of a directory)."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} is a directory{'; ' + directory_hint if directory_hint else ''}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise InputError(f"{what} cannot be read: {e.strerror or e}") from None
