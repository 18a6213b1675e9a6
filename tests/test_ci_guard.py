"""The emulated pass's guard (scripts/emulated_cpu_guard.py): what ``.ci/run`` checks before it runs tests under
``qemu-x86_64 -cpu Haswell``, so that a library built for the host's AVX-512 fails CI with one line, not a SIGILL
halfway through the pass. The AVX-512 case is made here on any host: a llama.cpp report that names AVX-512 (the
static check), and a native library compiled with ``-mavx512f`` that executes an AVX-512 instruction when it
loads (the emulated imports), which an AVX2 host cannot build into llama.cpp without minutes of compiling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cosyllama import cpu

ROOT = Path(__file__).resolve().parents[1]
GUARD = ROOT / "scripts" / "emulated_cpu_guard.py"
# llama.cpp's report on an AVX-512 host whose build had GGML_NATIVE on (Intel AMX, llama-cpp-python 0.3.36)
NATIVE_AVX512 = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                 "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "
                 "REPACK = 1 | ")
# the same on an AVX2 host (AMD EPYC, Zen 3)
NATIVE_AVX2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "


def guard(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GUARD), *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_a_build_compiled_for_avx512_is_refused_with_one_line_naming_it():
    r = guard("--cpu", "Haswell", "--features", NATIVE_AVX512)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    assert "AVX512, AVX512_VBMI" in lines[0] and "AVX_VNNI" in lines[0] and "SIGILL" in lines[0]
    assert "Traceback" not in r.stderr


def test_a_build_for_avx2_passes():
    r = guard("--cpu", "Haswell", "--features", NATIVE_AVX2)
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_extra_instruction_set_is_enough_to_refuse():
    r = guard("--cpu", "Haswell", "--features", NATIVE_AVX2 + "AVX_VNNI = 1 | ")
    assert r.returncode == 1 and "AVX_VNNI" in r.stdout


def _fake_llama(root: Path, variants: list[str]) -> Path:
    """A llama_cpp package that loads its CPU backend at run time, holding ``variants`` (never loaded here)."""
    lib = root / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (root / "llama_cpp" / "__init__.py").write_text("")
    for v in variants:
        (lib / f"libggml-cpu-{v}.so").write_bytes(b"")
    return root


def _env(pythonpath: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}


def test_a_run_time_dispatch_build_needs_the_variant_the_emulated_cpu_gets(tmp_path):
    ok = _fake_llama(tmp_path / "ok", ["x64", "haswell", "skylakex", "sapphirerapids"])
    assert guard("--static-only", env=_env(ok)).returncode == 0
    bad = _fake_llama(tmp_path / "bad", ["skylakex", "zen4"])
    r = guard("--static-only", env=_env(bad))
    assert r.returncode == 1 and "needs haswell" in r.stdout, r.stdout


@pytest.mark.parametrize("flags,variant", [
    ({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"}, "haswell"),
    ({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx_vnni"}, "alderlake"),
    ({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
     "skylakex"),
    ({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
      "avx512_vbmi", "avx512_vnni", "avx512_bf16", "avx_vnni"}, "zen4"),
    ({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
      "avx512_vbmi", "avx512_vnni", "avx512_bf16", "amx_int8", "avx_vnni"}, "sapphirerapids"),
    ({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2", "avx512f"}, "haswell"),  # AVX-512 F alone: ggml wants all five
    ({"sse4_2", "avx"}, "sandybridge"),
])
def test_the_variant_ggml_scores_best(flags, variant):
    """ggml's score (a power of two per feature, the newest highest) as cosyllama.cpu predicts it; the real
    loader is held to this by the container image's CPU line and the emulated pass (--expect-variant)."""
    assert cpu.ggml_cpu_variant(frozenset(flags)) == variant


AVX512_AT_LOAD = r"""
__attribute__((constructor)) static void uses_avx512(void) {
    __asm__ volatile("vpxorq %%zmm1, %%zmm1, %%zmm1" ::: "xmm1");
}
int answer(void) { return 42; }
"""


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None or shutil.which("gcc") is None,
                    reason="needs qemu-x86_64 (apt-get install qemu-user) and gcc")
def test_a_native_module_built_for_avx512_is_named_not_a_sigill(tmp_path):
    """The emulated imports: a module whose library runs an AVX-512 instruction when loaded (as a GGML_NATIVE
    build made on an AVX-512 host does) dies under the emulated Haswell; the guard names it and exits 1."""
    src = tmp_path / "avx512.c"
    src.write_text(AVX512_AT_LOAD)
    subprocess.run(["gcc", "-O1", "-mavx512f", "-shared", "-fPIC", "-o", str(tmp_path / "libavx512.so"), str(src)],
                   check=True)
    (tmp_path / "avx512probe.py").write_text(
        "import ctypes, os\nctypes.CDLL(os.path.join(os.path.dirname(__file__), 'libavx512.so'))\n")
    (tmp_path / "plain.py").write_text("x = 1\n")
    env = _env(_fake_llama(tmp_path / "dl", ["haswell"]))
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    r = guard("--cpu", "Haswell", "--modules", "plain,avx512probe", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines() == ["emulated Haswell: importing avx512probe under qemu -cpu Haswell "
                                             "ended with SIGILL"], r.stdout
    r = guard("--cpu", "Haswell", "--modules", "plain", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
