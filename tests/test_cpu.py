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


def test_a_onednn_cap_below_bf16_turns_native_bf16_off(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
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
