"""Run a benchmark script on this AVX-512 CPU with every library held to its AVX2 kernels: a stand-in for the
AVX2 class (AMD Zen 1/3) where no such machine is at hand. Its numbers are a proxy, never a measurement of that
class: the cores, clocks and memory stay this machine's (docs/performance-notes.md#the-avx2-class-through-a-proxy).

    python scripts/avx2_proxy.py --llama-wheel "$(deploy/llama-wheel.sh)"/llama_cpp_python-*.whl -- \\
        scripts/bench_first_audio.py --threads 2 --warm --prompt-cache-mb 512 --requests 3 --breakdown

What is held down, and how:

- PyTorch, oneDNN and MKL by their own switches (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``,
  ``MKL_ENABLE_INSTRUCTIONS=AVX2``), as ``.ci/run``'s forced pass does;
- llama.cpp by its CPU variants: ``--llama-wheel`` takes a llama-cpp-python wheel built with
  ``GGML_BACKEND_DL`` and ``GGML_CPU_ALL_VARIANTS`` (the container image's kind), installs it apart and keeps
  only the variants an AVX2 CPU without VNNI would load (haswell and below), so ggml picks haswell;
- the flow's int8 products on oneDNN only: fbgemm picks its kernels from CPUID and no switch holds it down, so
  its candidates are left out of ``auto`` (on the AVX2 class ``auto`` measured oneDNN fastest,
  docs/benchmarks.md#auto-on-the-avx2-class).

The run keeps a cache directory of its own (``--cache``; the model, GGUF and prompt files are linked from the
real one), so its ``auto`` verdicts, cached under this CPU's name, never replace the real ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# llama.cpp CPU variants an AVX2 CPU without AVX-VNNI or AVX-512 can load (ggml scores the others above them)
AVX2_VARIANTS = ("haswell", "sandybridge", "ivybridge", "piledriver", "sse42", "x64")
FORCED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

# Runs in the child before the script: oneDNN as the only int8 engine (see the module's docstring).
BOOTSTRAP = """
import runpy, sys
import cosyllama.flow.fast_dit as fast_dit, cosyllama.flow.cfm as cfm
fast_dit.INT8_ENGINES = ("onednn",)
fast_dit.INT8_ENGINE = cfm.INT8_ENGINE = "onednn"
cfm.INT8_ENGINES = ("onednn",)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def install_llama(wheel: Path, target: Path) -> list[str]:
    """Install ``wheel`` under ``target`` (once) with only the AVX2 CPU variants; returns the variants kept."""
    lib = target / "llama_cpp" / "lib"
    if not lib.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], check=True)
    variants = sorted(lib.glob("libggml-cpu-*.so"))
    if not variants:
        raise SystemExit(f"{wheel.name} has no CPU variants (build it with GGML_BACKEND_DL and "
                         "GGML_CPU_ALL_VARIANTS)")
    kept = []
    for so in variants:
        name = so.name[len("libggml-cpu-"):-len(".so")]
        if name in AVX2_VARIANTS:
            kept.append(name)
        else:
            so.unlink()
    if "haswell" not in kept:
        raise SystemExit(f"{wheel.name} has no haswell variant to load")
    return kept


def link_cache(real: Path, own: Path) -> None:
    """Link the real cache's model folders, GGUFs and prompt clips into ``own`` (nothing else: no verdicts)."""
    own.mkdir(parents=True, exist_ok=True)
    for item in real.iterdir() if real.is_dir() else ():
        if item.name in ("gguf", "wheels") or item.suffix == ".wav" or (item / "flow.pt").exists():
            link = own / item.name
            if not link.exists():
                link.symlink_to(item)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-wheel", required=True, help="a llama-cpp-python wheel with ggml's CPU variants")
    p.add_argument("--cache", default=None, help="the proxy's cache directory (default <cache>/avx2-proxy)")
    p.add_argument("script", help="the script to run, then its arguments (after --)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    from cosyllama.cachedir import cache_dir

    real = cache_dir()
    own = Path(a.cache) if a.cache else real / "avx2-proxy"
    kept = install_llama(Path(a.llama_wheel).expanduser(), own / "llama")
    link_cache(real, own)
    env = dict(os.environ, **FORCED_ENV, COSYLLAMA_CACHE=str(own))
    env["PYTHONPATH"] = os.pathsep.join([str(own / "llama")] + [x for x in [env.get("PYTHONPATH")] if x])
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    print(f"AVX2 proxy: {', '.join(f'{k}={v}' for k, v in FORCED_ENV.items())}; llama.cpp variants "
          f"{', '.join(kept)}; int8 on oneDNN only; cache {own}", file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-c", BOOTSTRAP, a.script, *args], env=env)


if __name__ == "__main__":
    sys.exit(main())
