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
