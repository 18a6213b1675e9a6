"""Keeping a long-running server's resident memory flat.

A server's RSS crept by 1-3 MB per short request (tiny model, llama.cpp, one request at a time:
386 MB after registering a voice, 652 MB after 100 requests, 808 MB after 300). Python's own
allocations stayed flat (tracemalloc); the growth was native, from three causes, measured one by
one (docs/benchmarks.md#server-soak-bounded-work-and-memory):

1. **oneDNN's primitive cache.** PyTorch runs CPU convolutions (flow, vocoder) and bf16 linear
   layers through oneDNN, which compiles a *primitive* per input shape and keeps up to 1,024, each
   with its own scratch memory. Every utterance length is a new shape, so the cache fills with
   primitives that are almost never used again (on the full-size vocoder about 90 MB per new
   length). With mkldnn off the growth vanished.
2. **ideep's cache in front of it**, also 1,024 entries, but one per thread: the server's thread
   pool multiplies it (8 concurrent requests: +18 % between the 100th and the 500th request with
   only oneDNN's cache bounded).
3. **glibc keeping freed memory.** Tensors of ever-changing sizes leave holes in glibc's heaps
   (one per thread that allocated) that are rarely reused whole; ``malloc_trim(0)`` gave back
   40-100 MB of them.

oneDNN and ideep read ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` once, when
they first need them, so :func:`bound_onednn_cache` must run before torch computes anything
(``cosyllama serve`` calls it first thing; values already in the environment win).
:func:`trim_heap` runs ``malloc_trim(0)``; the server calls it when a speech request ends. With
both, RSS stays within a few per cent over 500 mixed concurrent requests (the soak test).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ONEDNN_CACHE_CAPACITY = 64  # primitives in oneDNN's process-wide cache; a flow or vocoder call uses ~50 shapes
IDEEP_CACHE_CAPACITY = 1  # entries in ideep's per-thread cache in front of it (0 crashes torch 2.13)


def bound_onednn_cache() -> None:
    """Bound oneDNN's primitive cache and ideep's per-thread cache in front of it (unless
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` / ``LRU_CACHE_CAPACITY`` are set). Only effective before
    the process's first oneDNN computation."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_CACHE_CAPACITY))


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def trim_heap() -> bool:
    """Give glibc's free heap pages back to the OS (about 1 ms, 5 ms when there are tens of MB to
    give back). True if this is glibc and it ran."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


__all__ = ["IDEEP_CACHE_CAPACITY", "ONEDNN_CACHE_CAPACITY", "bound_onednn_cache", "trim_heap"]
