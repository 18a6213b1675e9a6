"""Can this Python environment run on an emulated CPU? One line saying what and why, before a SIGILL can.

``.ci/run``'s fourth pass runs the suite's process under ``qemu-x86_64 -cpu Haswell``. Wheels from the package
index are built for any x86-64 CPU and choose their kernels by CPUID at run time, so they run there; a library
built on this machine for this machine does not. The one such library in the test environment is llama.cpp: the
README's install builds it with ``GGML_NATIVE`` on, so on an AVX-512 host it carries AVX-512 instructions in
code that runs unconditionally, and the emulated process dies with "Illegal instruction" the first time a test
imports it. This script checks two ways, both before the pass:

1. statically, the llama.cpp build the emulated process would import: a build with every CPU variant
   (``GGML_BACKEND_DL`` + ``GGML_CPU_ALL_VARIANTS``, the container image's) must hold a variant the emulated CPU
   can run; a build with one CPU backend must be compiled for no instruction set the emulated CPU lacks
   (``llama_print_system_info`` reports the compiled-in ones, read natively, where they run);
2. dynamically, under the emulator, it imports each native module the pass loads (llama.cpp through
   cosyllama's own importer, which registers the run-time variants), in order, and names the one that died.

Exit 0 when both hold (printing what it checked), 1 with one line per problem otherwise, 2 on bad usage.

    python3 scripts/emulated_cpu_guard.py --cpu Haswell [--qemu qemu-x86_64] [--modules numpy,torch,...]
    python3 scripts/emulated_cpu_guard.py --cpu Haswell --static-only --features "AVX2 = 1 | AVX512 = 1"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from cosyllama.cpu import GGML_ISA_FLAGS, ggml_cpu_variant, llama_features_on

# What each emulated CPU model executes, in /proc/cpuinfo's names (QEMU's Haswell: AVX2 + FMA + F16C + BMI1/2, no
# AVX-512, no VNNI, no AMX).
EMULATED_CPUS = {
    "Haswell": frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "movbe", "avx", "f16c", "fma", "avx2",
                          "bmi1", "bmi2"}),
}

# The native modules the fourth pass's process loads, in the order the probe imports them. llama_cpp goes through
# cosyllama's importer, as the tests do (it also loads a run-time-dispatch build's best CPU variant).
DEFAULT_MODULES = ("numpy", "soundfile", "tokenizers", "onnxruntime", "torch", "llama_cpp")


def compiled_isa(features: str) -> list[str]:
    """The x86 instruction sets (ggml's names) a llama.cpp system-info string reports as on, in its order."""
    return [f for f in llama_features_on(features) if f in GGML_ISA_FLAGS]


def static_problems(cpu_name: str, lib_dir: Path | None, features: str | None) -> list[str]:
    """Why the llama.cpp build in ``lib_dir`` (its system info ``features``) cannot run on ``cpu_name``."""
    cpu = EMULATED_CPUS[cpu_name]
    if lib_dir is None:
        return []  # not installed: the tests that need it skip, nothing to load
    variants = sorted(p.name[len("libggml-cpu-"):-len(".so")] for p in lib_dir.glob("libggml-cpu-*.so"))
    if variants:
        want = ggml_cpu_variant(cpu)
        if want not in variants:
            return [f"llama.cpp at {lib_dir} loads its CPU backend at run time but has no variant an emulated "
                    f"{cpu_name} runs (it has {', '.join(variants)}; {cpu_name} needs {want})"]
        return []
    extra = [isa for isa in compiled_isa(features or "") if GGML_ISA_FLAGS[isa] not in cpu]
    if extra:
        return [f"llama.cpp at {lib_dir} is compiled for {', '.join(extra)}, which an emulated {cpu_name} lacks "
                f"(a GGML_NATIVE build made on this CPU): the emulated process would die with SIGILL on import; "
                f"give the pass a build that chooses its CPU variant at run time (deploy/llama-wheel.sh)"]
    return []


def find_llama(env: dict[str, str]) -> tuple[Path | None, str | None]:
    """The llama_cpp package the emulated process would import (same PYTHONPATH) and its system info, read
    natively (the build runs on the CPU it was made on, and a run-time-dispatch one on any)."""
    code = ("import importlib.util, json, os\n"
            "spec = importlib.util.find_spec('llama_cpp')\n"
            "if spec is None: print(json.dumps(None)); raise SystemExit\n"
            "lib = os.path.join(os.path.dirname(spec.origin), 'lib')\n"
            "import glob\n"
            "info = None\n"
            "if not glob.glob(os.path.join(lib, 'libggml-cpu-*.so')):\n"
            "    import llama_cpp\n"
            "    info = llama_cpp.llama_print_system_info().decode('utf-8', 'replace')\n"
            "print(json.dumps([lib, info]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"reading llama.cpp's build natively failed: {r.stderr.strip().splitlines()[-1:]}")
    found = json.loads(r.stdout.strip().splitlines()[-1])
    if found is None:
        return None, None
    return Path(found[0]), found[1]


PROBE = """
import sys
for name in sys.argv[1].split(","):
    print("importing", name, flush=True)
    if name == "llama_cpp":
        from cosyllama.llm.llamacpp_lib import cpu_variant, import_llama_cpp
        import_llama_cpp()
        print("variant", cpu_variant(), flush=True)
    else:
        __import__(name)
    print("ok", name, flush=True)
"""


def dynamic_problems(cpu_name: str, qemu: str, modules: list[str], env: dict[str, str]) -> tuple[list[str], str]:
    """Import ``modules`` one by one under ``qemu -cpu cpu_name``; the problems, and the variant llama.cpp chose."""
    python = sys.executable  # the interpreter (an ELF binary or a venv's link to one), not a pyenv shim script
    try:
        r = subprocess.run([qemu, "-cpu", cpu_name, python, "-c", PROBE, ",".join(modules)],
                           capture_output=True, text=True, env=env, timeout=900)
    except FileNotFoundError:
        return [f"{qemu} is not installed (apt-get install qemu-user)"], ""
    lines = r.stdout.splitlines()
    variant = next((ln.split(" ", 1)[1] for ln in lines if ln.startswith("variant ")), "")
    if r.returncode == 0:
        return [], variant
    started = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("importing ")]
    culprit = started[-1] if started else "the interpreter"
    signal = {-4: "SIGILL", 132: "SIGILL", -11: "SIGSEGV", 139: "SIGSEGV"}.get(r.returncode, f"exit {r.returncode}")
    last = [ln for ln in r.stderr.splitlines() if ln.strip() and "warning: TCG doesn't support" not in ln]
    why = f": {last[-1].strip()}" if last and signal.startswith("exit") else ""
    return [f"importing {culprit} under qemu -cpu {cpu_name} ended with {signal}{why}"], variant


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", default="Haswell", help="the emulated CPU model (one of: %(choices)s)",
                    choices=sorted(EMULATED_CPUS))
    ap.add_argument("--qemu", default="qemu-x86_64")
    ap.add_argument("--modules", default=",".join(DEFAULT_MODULES),
                    help="native modules to import under emulation, in order (default: %(default)s)")
    ap.add_argument("--static-only", action="store_true", help="skip the emulated imports")
    ap.add_argument("--features", help="check this llama.cpp system-info string instead of the installed build's")
    ap.add_argument("--expect-variant", help="fail unless a run-time-dispatch llama.cpp chose this variant")
    args = ap.parse_args(argv)
    env = dict(os.environ)

    if args.features is not None:
        problems = static_problems(args.cpu, Path("(--features)"), args.features)
        print("\n".join(problems) or f"llama.cpp features {', '.join(compiled_isa(args.features))} run on {args.cpu}")
        return 1 if problems else 0
    lib_dir, info = find_llama(env)
    problems = static_problems(args.cpu, lib_dir, info)
    variant = ""
    if not problems and not args.static_only:
        modules = [m for m in args.modules.split(",") if m and (m != "llama_cpp" or lib_dir is not None)]
        problems, variant = dynamic_problems(args.cpu, args.qemu, modules, env)
    if not problems and args.expect_variant and variant != args.expect_variant:
        problems = [f"llama.cpp chose the CPU variant {variant or 'none'} under qemu -cpu {args.cpu}, "
                    f"not {args.expect_variant}"]
    for p in problems:
        print(f"emulated {args.cpu}: {p}")
    if problems:
        return 1
    what = "no llama.cpp" if lib_dir is None else (
        f"llama.cpp at {lib_dir}" + (f" (variant {variant} chosen at run time)" if variant else ""))
    print(f"emulated {args.cpu}: {what}; " + ("static check only" if args.static_only else
                                              f"imported {args.modules} under {args.qemu}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
