"""Batch synthesis of a JSONL manifest, on one machine or on Ray (``cosyllama batch``).

:mod:`.manifest` checks rows, :mod:`.output` writes files and ``results.jsonl`` atomically,
:mod:`.engine` runs rows concurrently through the batching scheduler, :mod:`.ray_runner` runs the
same engine in Ray Data actors; the command is :mod:`cosyllama.commands.batch`.
"""

from .engine import BatchEngine, EngineOptions
from .manifest import BadRow, Manifest, Row, read_manifest

__all__ = ["BadRow", "BatchEngine", "EngineOptions", "Manifest", "Row", "read_manifest"]
