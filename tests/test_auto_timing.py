"""``--precision auto`` measures: every candidate that passes the fidelity check is timed on this machine and
the fastest is kept, the int8 engine being one of the choices (cosyllama.flow.check.choose_fastest).
Where a choice is asserted the timings are mocked, so no test depends on this machine's speed."""

from __future__ import annotations

import pytest
import torch

from cosyllama import precision as prec
from cosyllama.cpu import CpuPath
from cosyllama.flow import Flow, check, fast_dit
from cosyllama.precision import INT8
from helpers import MODEL_DIR


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """auto in its default (measuring) mode, with a fresh cache directory and memory."""
    monkeypatch.setenv("COSYLLAMA_AUTO", "measure")
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(check, "_memory", {})
    return tmp_path / "cache"


def _mock_times(monkeypatch, seconds: dict[str, float]):
    timed = []

    def fake(flow, cand):
        cand.apply(flow)
        timed.append(cand.name)
        return seconds[cand.name], False

    monkeypatch.setattr(check, "time_candidate", fake)
    return timed


@pytest.mark.parametrize("native,times,want,engine", [
    (True, {"fp32": 3.0, "bf16": 1.0, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.2},
     torch.bfloat16, None),
    (True, {"fp32": 3.0, "bf16": 1.6, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.7}, INT8,
     "onednn"),
    (True, {"fp32": 3.0, "bf16": 1.6, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.4}, INT8,
     "onednn+bf16"),
    (False, {"fp32": 3.0, "int8/fbgemm": 2.0, "int8/onednn": 2.5}, INT8, "fbgemm"),
    (False, {"fp32": 1.0, "int8/fbgemm": 2.0, "int8/onednn": 2.5}, torch.float32, None),
])
def test_auto_keeps_the_fastest_candidate(native, times, want, engine, monkeypatch, measuring):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: native)
    times = {k: v for k, v in times.items() if k.split("/")[-1] in ("fp32", "bf16") or
             fast_dit.int8_library(k.split("/")[-1]) in torch.backends.quantized.supported_engines}
    timed = _mock_times(monkeypatch, times)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    best = min(times, key=times.get)
    assert sorted(timed) == sorted(times)  # every candidate that passed was timed; bf16 only where native
    if best.split("/")[0] == prec.precision_name(want):
        assert flow.precision is want and c.chosen == prec.precision_name(want)
        if engine:
            assert flow.decoder.int8_engine == engine
    for name, s in times.items():
        assert f"{name} {s:.2f} s" in c.reason
    assert c.reason.startswith("auto: fastest here") and c.auto.chosen.name == best
    line = CpuPath(threads=1, flow=c.chosen, vocoder="fp32", flow_why=c.reason).lines()[1]
    assert f"flow {c.chosen} (auto: fastest here" in line


def test_a_candidate_that_fails_the_check_is_never_timed_nor_chosen(monkeypatch, measuring):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    real = fast_dit._Int8Linear.__call__
    monkeypatch.setattr(fast_dit._Int8Linear, "__call__", lambda self, x: real(self, x) * 1.05)  # 5 % off
    timed = _mock_times(monkeypatch, {"fp32": 9.0, "int8/fbgemm": 0.1, "int8/onednn": 0.1})
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    assert timed == ["fp32"] and flow.precision is torch.float32
    assert "failed the fidelity check" in flow.precision_choice.reason


def test_real_timings_are_cached_per_machine(monkeypatch, measuring):
    """On the real clock (whatever wins on the tiny model), the second process reads the timings back."""
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    first = flow.precision_choice.auto
    assert not first.cached and set(first.seconds) >= {"fp32"} and all(s > 0 for s in first.seconds.values())
    assert (measuring / "precision-checks.json").exists()
    monkeypatch.setattr(check, "_memory", {})  # a new process: the file answers
    again = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto
    assert again.cached and again.seconds == first.seconds and again.chosen == first.chosen


def test_rule_mode_keeps_the_class_rule(monkeypatch, measuring):
    monkeypatch.setenv("COSYLLAMA_AUTO", "rule")
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    timed = _mock_times(monkeypatch, {})
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    assert timed == [] and flow.precision is (INT8 if prec.int8_available() else torch.float32)
    assert flow.precision_choice.auto is None


def test_an_unknown_int8_engine_is_refused():
    from cosyllama.errors import InputError

    flow = Flow.from_dir(MODEL_DIR)
    with pytest.raises(InputError, match="int8 engine"):
        flow.decoder.set_compute_dtype(INT8, "mkl")
