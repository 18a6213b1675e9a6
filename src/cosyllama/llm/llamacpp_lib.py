"""Importing llama-cpp-python (lazily, once) and routing llama.cpp's log.

``import cosyllama`` never imports ``llama_cpp``; the llama.cpp backend and the GGUF quantizer call
:func:`import_llama_cpp`, which gives an install hint when the ``llama`` extra is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import MissingDependencyError

INSTALL_HINT = "pip install 'cosyllama[llama]'"

_import_lock = threading.Lock()
_llama_cpp = None
_log_callback = None  # the ctypes callback must stay referenced for as long as llama.cpp may call it
_log_handler: Callable[[int, str], None] | None = None
_log_verbose = False


def import_llama_cpp():
    """Import llama-cpp-python once, initialise the backend and take over its log output."""
    global _llama_cpp, _log_callback
    with _import_lock:
        if _llama_cpp is not None:
            return _llama_cpp
        try:
            import llama_cpp
        except ImportError as e:
            raise MissingDependencyError(f"the llama.cpp LLM backend needs llama-cpp-python: {INSTALL_HINT}") from e

        @llama_cpp.llama_log_callback
        def route(level: int, text: bytes, user_data) -> None:
            msg = text.decode("utf-8", errors="replace") if text else ""
            handler = _log_handler
            if handler is not None:
                handler(level, msg)
            elif _log_verbose:
                sys.stderr.write(msg)

        _log_callback = route
        llama_cpp.llama_log_set(route, ctypes.c_void_p(0))
        load_cpu_variants(llama_cpp)
        llama_cpp.llama_backend_init()
        _llama_cpp = llama_cpp
        return llama_cpp


def _lib_dir(llama_cpp) -> Path:
    return Path(llama_cpp.__file__).parent / "lib"


def load_cpu_variants(llama_cpp) -> None:
    """Register the best CPU backend of a build that loads them at run time (GGML_BACKEND_DL with
    GGML_CPU_ALL_VARIANTS, the container image's: one ``libggml-cpu-<variant>.so`` per CPU class, beside
    ``libggml.so``). ggml scores each variant against this CPU's CPUID and keeps the best; llama-cpp-python
    0.3.36 does not ask it to, and ggml looks only beside the Python executable. A build with its CPU backend
    linked in (no such files) is left alone."""
    lib_dir = _lib_dir(llama_cpp)
    if not any(lib_dir.glob("libggml-cpu-*.so")):
        return
    # ggml's functions as libllama resolves them: the wheel holds libggml.so and libggml.so.0 as two copies, and
    # loading the first by its path (llama_cpp._ggml) would make a second registry that llama.cpp never reads
    ggml = importlib.import_module("llama_cpp.llama_cpp")._lib
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    if ggml.ggml_backend_reg_by_name(b"CPU"):
        return
    ggml.ggml_backend_load_all_from_path.restype = None
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())


def cpu_variant() -> str | None:
    """The ggml CPU variant this process loaded (``haswell``, ``skylakex``, ``sapphirerapids``, ...), from its
    mapped libraries; None for a build with one CPU backend linked in, or before llama.cpp is loaded."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    found = re.search(r"/libggml-cpu-([A-Za-z0-9_]+)\.so", maps)
    return found.group(1) if found else None


def set_llama_verbose(verbose: bool) -> None:
    """Show (True) or hide (False, the default) llama.cpp's own log on stderr. Process-wide,
    because llama.cpp has a single log callback."""
    global _log_verbose
    _log_verbose = bool(verbose)


@contextlib.contextmanager
def llama_log_handler(handler: Callable[[int, str], None]) -> Iterator[None]:
    """Send llama.cpp log lines ``(ggml level, text)`` to ``handler`` inside the ``with`` block."""
    global _log_handler
    import_llama_cpp()
    previous, _log_handler = _log_handler, handler
    try:
        yield
    finally:
        _log_handler = previous


def openmp_serving_hint() -> str | None:
    """A one-line advice when this llama-cpp-python build threads with OpenMP, else None.

    Such a build shares libgomp with PyTorch (one copy is loaded per process), and libgomp cuts
    its threads' spin-waiting short once the thread teams of all threads together outnumber the
    cores — which a server's flow threads make happen. Measured with
    ``scripts/bench_concurrency.py --torch-thread`` on 2 vCPUs: 21-29 % slower decode, while a
    build without OpenMP (ggml's own thread pool) was unaffected.
    """
    info = import_llama_cpp().llama_print_system_info()
    info = info.decode("utf-8", "replace") if isinstance(info, bytes) else str(info)
    if "OPENMP = 1" not in info:
        return None
    return ("llama-cpp-python was built with OpenMP, which shares its threads with PyTorch's: with flow work "
            "running beside it, LLM decoding measured 21-38 % slower (0-14 % without OpenMP). Rebuild it "
            "without, as the README's install does: "
            'CMAKE_ARGS="-DGGML_OPENMP=OFF" pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python')
