"""llama.cpp never loads its AMX buffer type where its kernels crash (an AMX-INT8 CPU with a build that has
them), and keeps extra buffer types (repacked weights) everywhere else; the CPU flags and the build's features
are mocked, so every class is covered on any machine. The crash itself needs a full-size model on such a CPU
(the fixture model is too small to reach those kernels): docs/performance-notes.md#llamacpp-on-amx."""

from __future__ import annotations

import pytest

from cosyllama import cpu
from cosyllama.config import load_config

AMX_CPU = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"})
ZEN4_CPU = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"})
ZEN3_CPU = frozenset({"avx2", "fma"})
NATIVE_AMX_BUILD = "SSE3, AVX, AVX2, F16C, FMA, AVX512, AVX512_VNNI, AVX512_BF16, AMX_INT8, OPENMP, REPACK"
NO_AMX_BUILD = "SSE3, AVX, AVX2, F16C, FMA, AVX512, AVX512_VNNI, AVX512_BF16, OPENMP, REPACK"
AVX2_BUILD = "SSE3, AVX, AVX2, F16C, FMA, OPENMP, REPACK"


@pytest.mark.parametrize("flags,features,keep", [
    (AMX_CPU, NATIVE_AMX_BUILD, False),  # the crash: AMX kernels on an AMX CPU
    (AMX_CPU, NO_AMX_BUILD, True),  # built with -DGGML_AMX_INT8=OFF: repacking stays
    (ZEN4_CPU, NO_AMX_BUILD, True),
    (ZEN4_CPU, NATIVE_AMX_BUILD, True),  # no AMX on the CPU: ggml registers no AMX buffer type
    (ZEN3_CPU, AVX2_BUILD, True),  # AVX2: Q4_0 repacking is worth ~26 %
])
def test_extra_buffer_types_off_only_where_amx_kernels_would_run(flags, features, keep, monkeypatch):
    monkeypatch.delenv(cpu.LLAMA_EXTRA_BUFTS_ENV, raising=False)
    on, why = cpu.llama_extra_buffer_types(features, flags)
    assert on is keep
    assert ("AMX" in why) is (not keep)


@pytest.mark.parametrize("value,keep", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_overrides_the_choice(value, keep, monkeypatch):
    monkeypatch.setenv(cpu.LLAMA_EXTRA_BUFTS_ENV, value)
    for flags, features in ((AMX_CPU, NATIVE_AMX_BUILD), (ZEN3_CPU, AVX2_BUILD)):
        on, why = cpu.llama_extra_buffer_types(features, flags)
        assert on is keep and cpu.LLAMA_EXTRA_BUFTS_ENV in why


def test_the_cpu_line_says_what_was_chosen(monkeypatch):
    monkeypatch.setattr(cpu, "llama_cpp_features", lambda: NATIVE_AMX_BUILD)
    monkeypatch.setattr(cpu, "kernel_flags", lambda: AMX_CPU)  # the CPU as its kernels see it
    monkeypatch.delenv(cpu.LLAMA_EXTRA_BUFTS_ENV, raising=False)
    line = cpu.CpuPath(threads=2, llm="llamacpp").lines()[-1]
    assert line.startswith("llama.cpp build: ") and "AMX_INT8" in line
    assert "extra buffer types off" in line and "crash" in line


@pytest.mark.parametrize("keep", [False, True])
def test_the_backend_loads_with_the_choice(keep, tiny_gguf, model_dir, monkeypatch):
    """What the decision says reaches llama.cpp's model parameters, and the backend reports it."""
    lc = pytest.importorskip("llama_cpp")
    from cosyllama.llm import llamacpp_backend

    seen = []
    real = lc.llama_model_load_from_file

    def load(path, params):
        seen.append(bool(params.use_extra_bufts))
        return real(path, params)

    monkeypatch.setattr(lc, "llama_model_load_from_file", load)
    monkeypatch.setattr(llamacpp_backend, "llama_extra_buffer_types", lambda: (keep, f"mocked {keep}"))
    b = llamacpp_backend.LlamaCppLLM(tiny_gguf("speech", "F32"), load_config(model_dir))
    try:
        assert seen == [keep] and b.extra_buffer_types is keep and b.extra_buffer_types_why == f"mocked {keep}"
    finally:
        b.close()


@pytest.mark.parametrize("flags,want", [(AMX_CPU, False), (ZEN4_CPU, None), (ZEN3_CPU, None)])
def test_flash_attention_off_on_the_amx_class_only(flags, want):
    """Decoding measured ~12 % faster with llama.cpp's flash attention off on AMX, as fast or faster with it on
    elsewhere (docs/benchmarks.md#intel-amx): the default follows the class."""
    assert cpu.llama_flash_attention(flags) is want


@pytest.mark.parametrize("on_amx", [True, False])
def test_the_backend_takes_the_class_default_unless_asked(on_amx, tiny_gguf, model_dir, monkeypatch):
    pytest.importorskip("llama_cpp")
    from cosyllama.llm import llamacpp_backend

    monkeypatch.setattr(llamacpp_backend, "llama_flash_attention", lambda: False if on_amx else None)
    path = tiny_gguf("speech", "Q8_0")
    config = load_config(model_dir)
    b = llamacpp_backend.LlamaCppLLM(path, config)
    asked = llamacpp_backend.LlamaCppLLM(path, config, flash_attn=True)
    try:
        assert b.flash_attn is (False if on_amx else None) and asked.flash_attn is True
    finally:
        b.close()
        asked.close()
