"""The CPU path report (cosyllama.cpu) and the forced-ISA runs that keep the suite honest on every CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from cosyllama import cpu


@pytest.mark.parametrize("flags,cls", [
    ({"sse2"}, "baseline"), ({"avx2", "fma"}, "AVX2"), ({"avx2", "avx512f", "avx512_vnni"}, "AVX-512"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512-BF16"), ({"avx512f", "avx512_bf16", "amx_bf16"}, "AMX"),
])
def test_cpu_class_from_flags(flags, cls):
    assert cpu.cpu_class(frozenset(flags)) == cls
    assert cpu.has_native_bf16(frozenset(flags)) == (cls in ("AVX512-BF16", "AMX"))


@pytest.mark.parametrize("flags,vnni,reorder", [
    ({"avx2", "fma"}, False, False), ({"avx2", "avx_vnni"}, True, False), ({"avx2", "avx_ne_convert"}, False, True),
    ({"avx512f", "avx512bw", "avx512vl"}, False, False), ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, False, True),
    ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}, True, True),
])
def test_kernel_needs_from_flags(flags, vnni, reorder):
    """VNNI (int8 pairs added in int32, the static engine) and oneDNN's bf16 reorder (AVX-NE-CONVERT or
    AVX-512 BW + VL + DQ) from a stood-in CPU's flags."""
    assert cpu.has_vnni(frozenset(flags)) == vnni
    assert cpu.onednn_bf16_reorder_ok(frozenset(flags)) == reorder


def test_the_kernels_view_wins_over_proc_cpuinfo(monkeypatch):
    """Under QEMU's user mode /proc/cpuinfo is the host's while the kernels see the emulated CPU's CPUID: the
    decisions follow PyTorch's CPUID queries (here standing in a Haswell on an AVX512-BF16 host)."""
    import torch

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                                                               "avx512_bf16", "hypervisor"}))
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {
        "avx2": True, "fma3": True, "avx512_f": False, "avx512_bw": False, "avx512_vnni": False, "avx512_bf16": False,
        "amx_bf16": False, "avx_vnni": False, "num_sockets": 1, "cpu_name": "Intel Core Processor (Haswell)"})
    cpu.kernel_flags.cache_clear()
    try:
        assert cpu.kernel_flags() == {"avx2", "fma", "hypervisor"}
        assert cpu.cpu_class() == "AVX2" and cpu.isa_names() == ["AVX2", "FMA"] and not cpu.has_native_bf16()
    finally:
        monkeypatch.undo()
        cpu.kernel_flags.cache_clear()


def test_the_kernel_checks_agree_with_the_library():
    """The answers for this process are the libraries': PyTorch's CPUID queries, oneDNN's bf16 check and oneDNN's
    int8 product (where oneDNN is capped, by ONEDNN_MAX_CPU_ISA too)."""
    import torch

    caps = torch.cpu.get_capabilities()
    assert all((flag in cpu.kernel_flags()) == caps[name] for name, flag in (
        ("avx2", "avx2"), ("avx512_f", "avx512f"), ("avx512_vnni", "avx512_vnni"), ("avx512_bf16", "avx512_bf16"),
        ("avx_vnni", "avx_vnni"), ("amx_int8", "amx_int8")))
    if not os.environ.get("ONEDNN_MAX_CPU_ISA") and (caps["avx512_vnni"] or caps["avx_vnni"]):
        assert cpu.has_vnni()
    if not caps["avx512_vnni"] and not caps["avx_vnni"]:
        assert not cpu.has_vnni()
    assert cpu.onednn_bf16_reorder_ok() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if cpu.onednn_bf16_reorder_ok():
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), None)
    else:
        with pytest.raises(RuntimeError, match="bf16 path needs"):
            torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), None)


def test_a_onednn_cap_below_bf16_turns_native_bf16_off(monkeypatch):
    monkeypatch.setattr(cpu, "kernel_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu.has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu.has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_amx")
    assert cpu.has_native_bf16()


def test_isa_names_are_in_order():
    assert cpu.isa_names(frozenset({"amx_int8", "avx2", "avx512f", "avx512_vnni", "fma"})) == [
        "AVX2", "FMA", "AVX-512", "AVX512-VNNI", "AMX-INT8"]


def test_llama_cpp_features_keeps_what_is_on(monkeypatch):
    fake = types.SimpleNamespace(llama_print_system_info=lambda: b"CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | "
                                                                   b"AVX2 = 1 | OPENMP = 1 | ")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert cpu.llama_cpp_features() == "SSE3, AVX, AVX2, OPENMP"


def test_precision_reasons():
    assert cpu.precision_reason("fp32", "fp32") == "fixed by --precision"
    assert "no native bf16" in cpu.precision_reason("auto", "fp32")
    assert "vocoder at fp32" in cpu.precision_reason("auto", "fp32", stage="vocoder")
    assert "GPU" in cpu.precision_reason("auto", "bf16", "cuda")


def test_report_names_class_kernels_threads_and_precisions():
    lines = cpu.CpuPath(threads=3, flow="fp32", vocoder="fp32", llm="torch").lines()
    assert lines[0].startswith("cpu: ") and f"class {cpu.cpu_class()}" in lines[0] and "3 threads" in lines[0]
    assert "torch kernels" in lines[0]
    assert lines[1].startswith("precision on cpu: flow fp32 (") and "vocoder fp32" in lines[1]
    assert not any("llama.cpp" in line for line in lines)  # a torch-LLM run has no llama.cpp build to name


_PROBE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from helpers import MODEL_DIR, load_fixture
from cosyllama.flow import Flow
torch.set_num_threads(1)
a = load_fixture("e2e_zero_shot_nonstream")[0]
t = lambda k: torch.from_numpy(a[k])
mel = Flow.from_dir(MODEL_DIR).inference(t("flow_tokens"), t("in_flow_prompt_speech_token"), t("in_prompt_speech_feat"),
                                         t("in_flow_embedding"))
print(json.dumps({{"kernels": torch.backends.cpu.get_cpu_capability(), "mel": mel.flatten().tolist()}}))
"""


def _probe(env: dict) -> dict:
    code = _PROBE.format(tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_forcing_the_kernels_down_changes_them_and_the_numbers_but_not_the_result():
    """What `.ci/run`'s second pass relies on: ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA really switch
    PyTorch to other kernels (the flow's mel moves by float rounding), and the result stays within
    the flow tolerance of the recording either way."""
    import numpy as np

    from helpers import load_fixture

    want = load_fixture("e2e_zero_shot_nonstream")[0]["flow_call0_mel"].flatten()
    plain = _probe({k: "" for k in cpu.ISA_OVERRIDES})
    forced = _probe({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                     "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"})
    assert forced["kernels"] == "DEFAULT" and plain["kernels"] != "DEFAULT"
    a, b = np.array(plain["mel"]), np.array(forced["mel"])
    assert not np.array_equal(a, b), "forcing the kernels down did not change a single bit"
    assert np.abs(a - want).max() <= 1e-3 and np.abs(b - want).max() <= 1e-3


def test_forced_kernels_are_in_effect_in_this_run():
    """Under `.ci/run`'s forced pass, this process really runs the forced kernel set."""
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if not forced:
        pytest.skip("kernels not forced in this run")
    import torch

    assert torch.backends.cpu.get_cpu_capability().lower() == forced.lower()



def test_demo_says_what_its_rtf_means_here():
    from cosyllama.tools.demo import rtf_meaning

    text = rtf_meaning(cpu.CpuPath(threads=2, flow="fp32", vocoder="fp32", llm="torch"), segments=2)
    assert f"{cpu.cpu_class()} class" in text and "fp32" in text and "2 threads" in text
    assert "split into 2 segments" in text and 'section "Per CPU class"' in text
    one = rtf_meaning(cpu.CpuPath(threads=2, flow="bf16", vocoder="fp32", llm="torch"), segments=1)
    assert "segments" not in one and "not a broken install" not in one  # bf16 ran: nothing to excuse


def test_the_cpu_line_names_an_openmp_llama_build(monkeypatch):
    """An OpenMP build decodes slower beside the flow (docs/benchmarks.md#decoding-on-a-busy-machine): the CPU
    line that demo, bench and synth print says so; a build without OpenMP gets no note."""
    for features, note in (("AVX2, FMA, OPENMP, REPACK", True), ("AVX2, FMA, REPACK", False)):
        monkeypatch.setattr(cpu, "llama_cpp_features", lambda f=features: f)
        line = cpu.CpuPath(threads=2, llm="llamacpp").lines()[-1]
        assert line.startswith("llama.cpp build: ") and ("an OpenMP build" in line) is note, line


def test_the_cpu_line_names_the_ggml_cpu_variant_of_a_run_time_dispatch_build(monkeypatch, tmp_path):
    """A llama.cpp build with every CPU variant (the container image's, GGML_BACKEND_DL) loads one
    ``libggml-cpu-<variant>.so`` for this CPU: the CPU line names it, read from the process's mapped
    libraries; a build with its CPU backend linked in has none and the line says nothing of it."""
    from cosyllama.llm import llamacpp_lib

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /venv/site-packages/llama_cpp/lib/libggml-cpu-haswell.so\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(maps if p == "/proc/self/maps" else p, *a, **k))
    assert llamacpp_lib.cpu_variant() == "haswell"
    monkeypatch.setattr(cpu, "llama_cpp_features", lambda: "AVX2, FMA, REPACK")
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace())
    line = cpu.CpuPath(threads=2, llm="llamacpp").lines()[-1]
    assert "ggml CPU variant haswell (chosen at run time)" in line, line
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /venv/site-packages/llama_cpp/lib/libggml-cpu.so\n")
    assert "variant" not in cpu.CpuPath(threads=2, llm="llamacpp").lines()[-1]


def test_a_run_time_dispatch_llama_cpp_loads_the_variant_ggml_scores_best():
    """A llama.cpp build with every CPU variant (the container image's, and the one ``.ci/run``'s emulated pass
    imports) loads the variant :func:`cosyllama.cpu.ggml_cpu_variant` predicts from the kernels' view of the CPU:
    ``haswell`` under the emulated Haswell. Skipped for a build with its CPU backend linked in (the README's)."""
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")
    if not any((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu-*.so")):
        pytest.skip("this llama.cpp build has one CPU backend linked in, chosen when it was built")
    from cosyllama.llm.llamacpp_lib import cpu_variant, import_llama_cpp

    import_llama_cpp()
    assert cpu_variant() == cpu.ggml_cpu_variant(), sorted(cpu.kernel_flags())
    assert f"ggml CPU variant {cpu_variant()}" in "\n".join(cpu.CpuPath(threads=1, llm="llamacpp").lines())
