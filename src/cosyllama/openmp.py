"""PyTorch's OpenMP thread teams, and giving one back when a thread is done with model code.

PyTorch's Linux wheels run their parallel regions on libgomp, which keeps a team of worker threads for
every thread that has opened a region, until that thread ends. After each region a team's workers spin
a while before they sleep, so the next region finds them awake; but while libgomp's threads outnumber
the CPUs it may use, it cuts that spin to almost nothing (so that idle teams cannot take cores from a
busy one), and every region then waits for its workers to wake. Two teams of two threads on two cores
are enough: a model loaded on the main thread and served from another thread made each small region
cost about three times as much (a GELU over 212 x 1024 floats: 50 us a call on one team, 145 us once a
second thread had run one matrix product), and a warmed voice's first streamed flow call 0.9 -> 1.3 s
(docs/performance-notes.md, "One OpenMP team at a time").

:func:`release_thread_team` gives the calling thread's team back (OpenMP 5.0's
``omp_pause_resource_all``, which libgomp carries out for the calling thread alone: other threads'
teams are untouched, and this thread's next region makes a new team, a thread start per worker). It
runs after loading, making or warming a voice (:func:`gives_team_back`), after each flow and vocoder
call of a pipeline, after each call on a server's model threads, on the thread that prepared a server or
a batch engine, and in the batching scheduler before it waits, so that only the threads working now hold
a team. Elsewhere (another OpenMP runtime: LLVM's or Intel's, macOS, Windows) it does nothing.

The one case that wants the cut spin: llama.cpp's own thread pool (the README's ``-DGGML_OPENMP=OFF``
build), which libgomp does not see, decoding beside a flow call on two cores. Workers spinning there take
the cores llama.cpp's threads need (a stream of 150 tokens under ``--interleave first`` on 2 cores: 19 s,
31 s when the scheduler held no team after the first chunk). So the scheduler holds a team whenever it decodes
(:func:`hold_thread_team`), which keeps libgomp's count above the cores while both stages run.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys

OMP_PAUSE_SOFT = 1  # omp_pause_soft of omp.h's omp_pause_resource_t
ATEN_GRAIN = 32768  # ATen's GRAIN_SIZE: an elementwise op over fewer elements per thread stays on the caller
_LIBGOMP = re.compile(r"(/\S*/libgomp[^/\s]*\.so[^/\s]*)$")


def _loaded_libgomp() -> list[str]:
    """The libgomp files mapped into this process (torch's own copy first), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {m.group(1) for line in f if (m := _LIBGOMP.search(line.strip()))}
    except OSError:
        return []
    return sorted(paths, key=lambda p: "/torch/" not in p)


@functools.lru_cache(maxsize=None)
def _pause():
    """libgomp's ``omp_pause_resource_all`` as PyTorch's parallel regions use it, or None where
    PyTorch's parallel backend is not libgomp (checked once, after torch is imported)."""
    if not sys.platform.startswith("linux"):
        return None
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for path in _loaded_libgomp():
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all  # the library already loaded: no second copy
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0 has no pause
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_thread_team() -> bool:
    """Give back the OpenMP worker threads the calling thread holds (see the module docstring); the
    thread's next parallel region makes them again. True if libgomp did so (or the thread held none);
    False where there is no libgomp to ask, or inside a parallel region."""
    fn = _pause()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0


def gives_team_back(fn):
    """``fn`` as model code a thread runs and then leaves for other work (loading, making a voice, a server's
    call): the thread gives its team back when ``fn`` returns or raises."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            release_thread_team()

    return run


def hold_thread_team() -> None:
    """Make sure the calling thread holds an OpenMP team: one parallel region of PyTorch's over two
    threads' worth of elements (a thread start when it holds none, microseconds when it does; nothing where
    :func:`can_release` is False). The
    batching scheduler holds one while llama.cpp decodes beside flow calls (see the module docstring)."""
    if _pause() is None:
        return
    import torch

    torch.empty(2 * ATEN_GRAIN).fill_(0)


def can_release() -> bool:
    """Whether :func:`release_thread_team` does anything here (PyTorch on libgomp with OpenMP 5.0's pause)."""
    return _pause() is not None


__all__ = ["can_release", "gives_team_back", "hold_thread_team", "release_thread_team"]
