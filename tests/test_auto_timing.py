"""``--precision auto`` measures: every candidate that passes the fidelity check is timed on this machine in
interleaved rounds and the fastest is kept, the int8 engine being one of the choices
(cosyllama.flow.auto.choose_fastest). A busy machine cannot fool it: a measurement during which the process
got too little of the CPU, or taken at a load average above the cores, is not cached; the rule of thumb runs
and the next start measures again. Where a choice is asserted the clock, the load average and the process's
CPU time are mocked (the ``machine`` fixture), so no test depends on this machine's speed or load."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from cosyllama import precision as prec
from cosyllama.cpu import CpuPath
from cosyllama.flow import Flow, auto, check, fast_dit
from cosyllama.precision import INT8
from helpers import MODEL_DIR

T0 = 1_800_000_000.0  # the mocked clock's start (seconds since the epoch)


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """auto in its default (measuring) mode, with a fresh cache directory and memory."""
    monkeypatch.setenv("COSYLLAMA_AUTO", "measure")
    monkeypatch.setenv("COSYLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(check, "_memory", {})
    return tmp_path / "cache"


@dataclass
class Machine:
    """The mocked machine: ``seconds`` per candidate for one timed solve, the CPU ``share`` the process gets
    of what its threads ask for, the load averages, the clock; ``solves`` lists every solve's candidate."""

    seconds: dict[str, float] = field(default_factory=dict)
    share: float = 0.97
    load: tuple[float, float, float] | None = (0.3, 0.2, 0.1)
    cores: int = 2
    now: float = T0
    solves: list[str] = field(default_factory=list)
    attention: tuple | None = None  # what auto.attention_seconds gives (None: no projection, the timed seconds count)

    def solve(self, flow, cand, inp):
        cand.apply(flow)
        self.solves.append(cand.name)
        wall = self.seconds[cand.name]
        return wall, wall * torch.get_num_threads() * self.share


@pytest.fixture(scope="module")
def check_outcomes(tmp_path_factory) -> dict:
    """The fidelity checks of every candidate on the fixture model, run once for the module (a test that
    makes a candidate fail its check uses ``fresh_machine``, which runs them again)."""
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("checks")
        mp.setenv("COSYLLAMA_CACHE", str(cache))
        mp.setattr(check, "_memory", {})
        mp.setattr(prec, "cpu_has_native_bf16", lambda: True)
        mp.setattr(prec, "cpu_has_int8_vnni", lambda: True)  # see vnni below
        flow = Flow.from_dir(MODEL_DIR)
        ref: dict = {}
        for cand in auto.candidates(flow):
            if cand.dtype != torch.float32:
                assert check.check_candidate(flow, cand, ref).passed
        return json.loads((cache / "precision-checks.json").read_text())


@pytest.fixture(autouse=True)
def vnni(monkeypatch):
    """VNNI counted present, so the static engine is among the candidates as on a CPU with it: the timings here are
    the Machine's and the choices are the subject (without VNNI the engine's products saturate: its fidelity is
    tested in test_flow_int8.py where the CPU has VNNI)."""
    monkeypatch.setattr(prec, "cpu_has_int8_vnni", lambda: True)


@pytest.fixture
def fresh_machine(monkeypatch, measuring):
    m = Machine()
    monkeypatch.setattr(auto, "_solve", m.solve)
    monkeypatch.setattr(auto, "_clock", lambda: m.now)
    monkeypatch.setattr(auto, "_loadavg", lambda: m.load)
    monkeypatch.setattr(auto, "_cores", lambda: m.cores)
    monkeypatch.setattr(auto, "_attention_seconds", lambda flow, cands: m.attention)
    return m


@pytest.fixture
def machine(fresh_machine, measuring, check_outcomes):
    """:func:`fresh_machine` with the fidelity checks already cached."""
    measuring.mkdir(parents=True, exist_ok=True)
    (measuring / "precision-checks.json").write_text(json.dumps(check_outcomes))
    return fresh_machine


def _new_process(monkeypatch):
    monkeypatch.setattr(check, "_memory", {})  # the file answers


def _names(native: bool) -> list[str]:
    """auto's candidates here with bf16 native or not (the int8 engines this PyTorch build has)."""
    out = ["fp32"] + (["bf16"] if native else [])
    return out + [f"int8/{e}" for e in fast_dit.INT8_ENGINES if fast_dit.int8_engine_problem(e) is None]


def _times(native: bool, **given: float) -> dict[str, float]:
    base = {"fp32": 3.0, "bf16": 1.0, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.2,
            "int8/onednn+bf16+static": 1.15}
    base.update({k.replace("__", "/").replace("_bf16", "+bf16"): v for k, v in given.items()})
    return {n: base[n] for n in _names(native)}


def _verdicts(cache) -> dict:
    path = cache / "precision-checks.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    return {k: v for k, v in data.items() if k.startswith("auto|")}


@pytest.mark.parametrize("native,times,want,engine", [
    (True, {"fp32": 3.0, "bf16": 1.0, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.2,
            "int8/onednn+bf16+static": 1.1}, torch.bfloat16, None),
    (True, {"fp32": 3.0, "bf16": 1.6, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.7,
            "int8/onednn+bf16+static": 1.55}, INT8, "onednn"),
    (True, {"fp32": 3.0, "bf16": 1.6, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.3,
            "int8/onednn+bf16+static": 1.45}, INT8, "onednn+bf16"),  # 1.12x its static twin (DYNAMIC_MIN_GAIN)
    (True, {"fp32": 3.0, "bf16": 1.6, "int8/fbgemm": 2.0, "int8/onednn": 1.5, "int8/onednn+bf16": 1.4,
            "int8/onednn+bf16+static": 1.25}, INT8, "onednn+bf16+static"),
    (False, {"fp32": 3.0, "int8/fbgemm": 2.0, "int8/onednn": 2.5}, INT8, "fbgemm"),
    (False, {"fp32": 1.0, "int8/fbgemm": 2.0, "int8/onednn": 2.5}, torch.float32, None),
])
def test_auto_keeps_the_fastest_candidate(native, times, want, engine, monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: native)
    machine.seconds = {k: v for k, v in times.items() if k in _names(native)}
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    best = min(machine.seconds, key=machine.seconds.get)
    assert sorted(set(machine.solves)) == sorted(machine.seconds)  # every candidate that passed; bf16 only if native
    if best.split("/")[0] == prec.precision_name(want):
        assert flow.precision is want and c.chosen == prec.precision_name(want)
        if engine:
            assert flow.decoder.int8_engine == engine
    for name, s in machine.seconds.items():
        assert f"{name} {s:.2f} s" in c.reason
    assert c.reason.startswith("auto: fastest here, measured now at load 0.3, CPU 97% of")
    assert c.auto.chosen.name == best
    line = CpuPath(threads=1, flow=c.chosen, vocoder="fp32", flow_why=c.reason).lines()[1]
    assert f"flow {c.chosen} (auto: fastest here, measured now" in line


@pytest.mark.parametrize("times,want", [
    ({"fp32": 3.9, "int8/fbgemm": 3.05, "int8/onednn": 3.8}, "fp32"),  # 1.28x (Zen 1's timing): the exact path stays
    ({"fp32": 3.9, "int8/fbgemm": 2.99, "int8/onednn": 3.8}, "int8/fbgemm"),  # just past 1.3x
    ({"fp32": 3.9, "int8/fbgemm": 2.9, "int8/onednn": 2.6}, "int8/onednn"),  # both past it: the fastest
])
def test_a_lossy_path_must_beat_fp32_by_the_margin(times, want, monkeypatch, machine):
    assert auto.LOSSY_MIN_GAIN == 1.3
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    machine.seconds = times
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert c.auto.chosen.name == want
    (rec,) = _verdicts(check.cache_dir()).values()
    assert rec["verdict"] == want
    if want == "fp32":
        assert c.reason.startswith("auto: fp32 kept, no lossy path is 1.3x faster here, measured now")
        assert "int8/fbgemm 3.05 s" in c.reason
    else:
        assert c.reason.startswith("auto: fastest here, measured now")


def test_the_verdict_is_taken_on_the_times_projected_to_the_real_size(monkeypatch, machine):
    """Timed 1.5x fp32 on the small solve, int8 would pass the margin; with attention taking 0.5 s of each
    timed solve and 8 s of each at the real size (4x the frames: same work for both, as on AVX512-BF16 without
    AMX), the projections are fp32 2.5 x 4 + 8 = 18 s and int8 1.5 x 4 + 8 = 14 s: 1.29x, so fp32 stays."""
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    machine.seconds = {"fp32": 3.0, "int8/fbgemm": 2.0, "int8/onednn": 2.2}
    machine.attention = ({n: [0.5, 8.0] for n in machine.seconds}, 4.0)
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert c.auto.chosen.name == "fp32"
    assert c.auto.projected == {"fp32": 18.0, "int8/fbgemm": 14.0, "int8/onednn": 14.8}
    assert c.reason.startswith("auto: fp32 kept, no lossy path is 1.3x faster here, measured now")
    (rec,) = _verdicts(check.cache_dir()).values()
    assert rec["verdict"] == "fp32" and rec["scale"] == 4.0 and rec["attention"]["fp32"] == [0.5, 8.0]
    assert auto.Measurement.from_record(rec).projected == c.auto.projected  # the cached record projects alike

    # attention cheap at the real size (AMX's bf16 tiles for the lossy path, fp32's own kernel slow): int8 wins
    machine.attention = ({"fp32": [0.5, 8.0], "int8/fbgemm": [0.2, 2.0], "int8/onednn": [0.2, 2.0]}, 4.0)
    _new_process(monkeypatch)
    monkeypatch.setattr(auto, "VERDICT_VERSION", auto.VERDICT_VERSION + 1)  # no cached verdict
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert c.auto.chosen.name == "int8/fbgemm"  # 18 / (1.8 x 4 + 2 = 9.2) = 1.96x
    assert "projected to 75+250 tokens: fp32 / int8/fbgemm 1.96x" in c.reason


def test_static_scales_are_kept_unless_their_dynamic_twin_is_clearly_faster():
    """The mixed int8 path with dynamic scales replaces its static twin only when 1.1x faster (the timed solve
    cannot tell them apart where fixed costs dominate it; at real sizes static was 1.28x faster on a Zen 4)."""
    names = ("fp32", "bf16", "int8/onednn+bf16", "int8/onednn+bf16+static")
    by_name = {n: auto.Candidate(torch.float32 if n == "fp32" else torch.bfloat16 if n == "bf16" else INT8,
                                 None if n in ("fp32", "bf16") else n.split("/", 1)[1]) for n in names}
    assert all(c.name == n for n, c in by_name.items())

    def pick(mixed, static, **more):
        return auto.verdict({"fp32": 10.0, "bf16": 4.0, "int8/onednn+bf16": mixed, "int8/onednn+bf16+static": static,
                             **more}, by_name).name

    assert pick(2.54, 2.56) == "int8/onednn+bf16+static"  # a tie (the Zen 4's timed solve)
    assert pick(2.35, 2.56) == "int8/onednn+bf16+static"  # 1.09x: still within the margin
    assert pick(2.30, 2.56) == "int8/onednn+bf16"  # 1.11x
    assert pick(2.56, 2.30) == "int8/onednn+bf16+static"  # static faster anyway
    assert pick(2.54, 9.0) == "int8/onednn+bf16"  # a static twin slower than fp32's margin is no candidate
    assert auto.verdict({"fp32": 10.0, "int8/onednn+bf16": 2.5}, by_name).name == "int8/onednn+bf16"  # no twin
    assert pick(3.0, 3.1, bf16=2.0) == "bf16"  # the preference is between twins only


def test_the_cpu_line_says_when_static_scales_were_kept(monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    machine.seconds = {"fp32": 9.0, "bf16": 3.4, "int8/fbgemm": 3.6, "int8/onednn": 3.5, "int8/onednn+bf16": 2.54,
                       "int8/onednn+bf16+static": 2.56}
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    if "int8/onednn+bf16+static" not in c.auto.seconds:
        pytest.skip("the static engine cannot run here (no VNNI)")
    assert c.auto.chosen.name == "int8/onednn+bf16+static"
    assert c.reason.startswith("auto: static scales kept, their dynamic twin is not 1.1x faster here, measured now")


def test_a_record_without_attention_timings_counts_its_timed_seconds():
    rec = {"rounds": {"fp32": [3.0, 3.1], "bf16": [1.0, 1.2]}, "order": ["fp32", "bf16", "bf16", "fp32"],
           "cpu_share": 0.97, "threads": 2, "cores": 2, "wall_s": 8.3, "measured_at": T0}
    m = auto.Measurement.from_record(rec)
    assert m.attention is None and m.projected == m.seconds == {"fp32": 3.0, "bf16": 1.0}


def test_attention_is_timed_per_attention_dtype_at_both_sizes(monkeypatch):
    """On the fixture model: every candidate gets its solve's attention seconds at the timed and the real size,
    the candidates that run attention in bf16 (bf16, the mixed int8 paths) the same ones, the others fp32's."""
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    flow = Flow.from_dir(MODEL_DIR)
    cands = auto.candidates(flow)
    real_call, calls = auto._attention_call, []

    def call(frames, heads, dim_head, dtype, reps=3):  # a real call, reported by its shape (no race on its speed)
        calls.append((frames, dtype))
        assert real_call(frames, heads, dim_head, dtype, 1) > 0
        return frames * (2.0 if dtype == torch.bfloat16 else 3.0)

    monkeypatch.setattr(auto, "_attention_call", call)
    att, scale = auto.attention_seconds(flow, cands)
    small, real = (flow.cfg.token_mel_ratio * (p + n) for p, n in ((auto.TIME_PROMPT_TOKENS, auto.TIME_TOKENS),
                                                                    (auto.REAL_PROMPT_TOKENS, auto.REAL_TOKENS)))
    assert scale == pytest.approx(real / small)
    assert sorted(calls, key=str) == sorted([(n, dt) for n in (small, real) for dt in (torch.float32, torch.bfloat16)],
                                            key=str)  # once per attention dtype and size
    per_call = len(flow.decoder.estimator.transformer_blocks) * flow.decoder.n_timesteps
    assert set(att) == {c.name for c in cands}
    bf16 = {n for n in att if n == "bf16" or n.endswith(("+bf16", "+bf16+static"))}
    assert "bf16" in bf16 and all(att[n] == [per_call * 2.0 * small, per_call * 2.0 * real] for n in bf16)
    assert all(att[n] == [per_call * 3.0 * small, per_call * 3.0 * real] for n in att if n not in bf16)


def test_candidates_are_timed_in_interleaved_rounds(monkeypatch, machine):
    """Each candidate is warmed once, then the rounds run A B C, C B A: a machine that slows down during
    the measurement slows every candidate alike, and each candidate's best round counts."""
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    names = _names(True)
    machine.seconds = _times(True)
    Flow.from_dir(MODEL_DIR, precision="auto")
    assert auto.TIME_ROUNDS == 2
    assert machine.solves == names + names + names[::-1]


def test_a_quiet_measurement_is_cached_with_its_record(monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    machine.seconds = _times(True)
    machine.load = (0.25, 0.5, 0.75)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    assert flow.precision_choice.auto.source == "measured"
    (rec,) = _verdicts(check.cache_dir()).values()
    threads = torch.get_num_threads()
    assert rec["verdict"] == "bf16" and rec["measured_at"] == T0 and rec["threads"] == threads and rec["cores"] == 2
    assert rec["load_before"] == [0.25, 0.5, 0.75] and rec["load_after"] == [0.25, 0.5, 0.75]
    assert rec["cpu_share"] == pytest.approx(0.97)
    assert rec["rounds"] == {n: [s, s] for n, s in machine.seconds.items()} and rec["seconds"] == machine.seconds
    assert rec["order"] == machine.solves[len(machine.seconds):]  # the rounds, not the warm-ups

    machine.now = T0 + 3 * 3600 + 60
    machine.solves.clear()
    _new_process(monkeypatch)
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert machine.solves == [] and c.auto.source == "cached" and c.auto.cached and c.chosen == "bf16"
    assert c.reason.startswith(f"auto: fastest here, measured 3 h ago at load 0.2, CPU 97% of {threads} threads")


@pytest.mark.parametrize("native,rule", [(True, "bf16"), (False, "int8/fbgemm")])
def test_a_busy_measurement_is_not_cached_and_the_rule_of_thumb_runs(native, rule, monkeypatch, machine):
    """The process got half the CPU its threads asked for (two busy threads beside two on two cores): the
    timings are shown but not cached, the class rule runs (after its fidelity check), and the line says so."""
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: native)
    machine.seconds = _times(native, int8__onednn=0.5)  # int8/onednn "wins" under load
    machine.share = 0.5
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    assert machine.solves  # it did time
    assert c.auto.source == "rule" and c.auto.chosen.name == rule and c.auto.cached is False
    assert flow.precision is (torch.bfloat16 if native else INT8)
    if not native:
        assert flow.decoder.int8_engine == "fbgemm"
    assert c.reason.startswith("auto: rule of thumb, ")
    assert "the machine was busy while timing: CPU 50% of" in c.reason and "(needs 80%)" in c.reason
    assert "not cached, measures again on the next start" in c.reason and "int8/onednn 0.50 s" in c.reason
    assert _verdicts(check.cache_dir()) == {} and not any(k.startswith("auto|") for k in check._memory)
    line = CpuPath(threads=2, flow=c.chosen, vocoder="fp32", flow_why=c.reason).lines()[1]
    assert "auto: rule of thumb" in line and "busy while timing" in line


def test_the_rule_of_thumb_is_fp32_when_the_class_candidate_fails_the_check(monkeypatch, fresh_machine):
    machine = fresh_machine
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    real = fast_dit._LowpLinear.__call__
    monkeypatch.setattr(fast_dit._LowpLinear, "__call__", lambda self, x: real(self, x) * 1.05)  # bf16 5 % off
    machine.seconds = _times(True)
    machine.share = 0.3
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    assert c.auto.source == "rule" and flow.precision is torch.float32 and "failed the fidelity check: bf16" in c.reason
    assert "rule of thumb, fp32" in c.reason


def test_a_load_average_above_the_cores_skips_the_timing(monkeypatch, machine):
    """At load 6.5 on 2 cores the numbers would be refused anyway: nothing is timed, nothing cached."""
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    machine.seconds = _times(True)
    machine.load = (6.5, 6.0, 5.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    c = flow.precision_choice
    assert machine.solves == [] and c.auto.source == "rule" and c.chosen == "bf16" and c.auto.measurement is None
    assert "load average 6.5 on 2 cores (needs <= 3) before timing" in c.reason
    assert _verdicts(check.cache_dir()) == {}
    machine.load = (2.9, 6.0, 5.0)  # within cores + 1: it times (and the CPU share decides)
    _new_process(monkeypatch)
    assert Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto.source == "measured"


def test_the_next_start_measures_again_after_a_refused_cache(monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    machine.seconds = _times(True, int8__onednn=0.5)
    machine.share = 0.4
    assert Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto.source == "rule"
    first = len(machine.solves)
    assert first > 0

    _new_process(monkeypatch)  # a later start, the machine now quiet: it measures again, and caches
    machine.now += 600
    machine.seconds = _times(True)
    machine.share = 0.98
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert len(machine.solves) == 2 * first and c.auto.source == "measured" and c.chosen == "bf16"
    (rec,) = _verdicts(check.cache_dir()).values()
    assert rec["measured_at"] == T0 + 600 and rec["verdict"] == "bf16"

    _new_process(monkeypatch)  # and the start after that reads it back
    assert Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto.source == "cached"
    assert len(machine.solves) == 2 * first


def test_a_verdict_does_not_expire_by_age_but_shows_it(monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    machine.seconds = _times(False)
    Flow.from_dir(MODEL_DIR, precision="auto")
    machine.now = T0 + 40 * 86400
    machine.solves.clear()
    _new_process(monkeypatch)
    c = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice
    assert machine.solves == [] and "measured 40 d ago" in c.reason


def test_another_thread_count_measures_again(monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    machine.seconds = _times(False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    Flow.from_dir(MODEL_DIR, precision="auto")
    n = len(machine.solves)
    _new_process(monkeypatch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto.source == "measured"
    assert len(machine.solves) == 2 * n and len(_verdicts(check.cache_dir())) == 2


def test_a_record_of_another_shape_is_measured_again(monkeypatch, machine):
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    machine.seconds = _times(False)
    Flow.from_dir(MODEL_DIR, precision="auto")
    path = check.cache_dir() / "precision-checks.json"
    data = json.loads(path.read_text())
    (key,) = _verdicts(check.cache_dir())
    for broken in ({"seconds": 1.0}, {**data[key], "rounds": [1.0]}, {**data[key], "verdict": "fp64"}, [1]):
        data[key] = broken  # e.g. a timing cached before verdicts had records
        path.write_text(json.dumps(data))
        _new_process(monkeypatch)
        assert Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto.source == "measured"


def test_a_candidate_that_fails_the_check_is_never_timed_nor_chosen(monkeypatch, fresh_machine):
    machine = fresh_machine
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    real = fast_dit._Int8Linear.__call__
    monkeypatch.setattr(fast_dit._Int8Linear, "__call__", lambda self, x: real(self, x) * 1.05)  # 5 % off
    machine.seconds = {"fp32": 9.0, "int8/fbgemm": 0.1, "int8/onednn": 0.1}
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    assert set(machine.solves) == {"fp32"} and flow.precision is torch.float32
    assert "failed the fidelity check" in flow.precision_choice.reason


def test_real_timings_are_cached_per_machine(monkeypatch, measuring):
    """On the real clock (whatever wins on the tiny model; the busy-machine rules are lifted, as the shared
    test machine is rarely quiet), the second process reads the verdict back."""
    monkeypatch.setattr(auto, "CPU_SHARE_MIN", 0.0)
    monkeypatch.setattr(auto, "LOAD_SLACK", 1e9)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    first = flow.precision_choice.auto
    assert first.source == "measured" and set(first.seconds) >= {"fp32"}
    assert all(s > 0 for s in first.seconds.values()) and 0 < first.measurement.cpu_share
    assert (measuring / "precision-checks.json").exists()
    _new_process(monkeypatch)
    again = Flow.from_dir(MODEL_DIR, precision="auto").precision_choice.auto
    assert again.cached and again.seconds == first.seconds and again.chosen == first.chosen


def test_rule_mode_keeps_the_class_rule(monkeypatch, machine):
    monkeypatch.setenv("COSYLLAMA_AUTO", "rule")
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: False)
    flow = Flow.from_dir(MODEL_DIR, precision="auto")
    assert machine.solves == [] and flow.precision is (INT8 if prec.int8_available() else torch.float32)
    assert flow.precision_choice.auto is None and "rule of thumb: COSYLLAMA_AUTO=rule" in flow.precision_choice.reason


def test_a_fixed_precision_says_so_on_the_cpu_line(machine):
    c = Flow.from_dir(MODEL_DIR, precision="bf16").precision_choice
    assert machine.solves == [] and c.reason == "fixed by --precision"
    assert CpuPath(threads=1, flow="bf16", vocoder="fp32", requested="bf16", flow_why=c.reason).lines()[1] == \
        "precision on cpu: flow bf16 (fixed by --precision); vocoder fp32 (fixed by --precision)"


@pytest.mark.parametrize("seconds,want", [(0, "0 s"), (59, "59 s"), (61, "1 min"), (3 * 3600, "3 h"),
                                          (2 * 86400 + 5, "2 d"), (-5, "0 s")])
def test_ages_read_as_a_person_would_say_them(seconds, want):
    assert auto.format_age(seconds) == want


# ----------------------------------------------------------------------------------------------
# cosyllama bench --parts auto


def test_bench_measures_again_and_shows_the_verdict_beside_the_cached_one(monkeypatch, machine, capsys, request):
    from cosyllama.cli import main

    real_threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(real_threads))  # bench sets --threads for the process
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the verdict's key: the same as bench's --threads 2
    monkeypatch.setattr(prec, "cpu_has_native_bf16", lambda: True)
    machine.seconds = _times(True, int8__onednn=0.5)
    Flow.from_dir(MODEL_DIR, precision="auto")  # cached: int8/onednn
    machine.solves.clear()
    machine.now = T0 + 2 * 86400
    machine.seconds = _times(True)  # now bf16 is the fastest
    argv = ["bench", "--parts", "auto", "--model-dir", str(MODEL_DIR), "--threads", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert machine.solves == _names(True) * 2 + _names(True)[::-1]  # timed again though cached and quiet
    assert "auto: the flow candidates timed again (25+50 tokens, 2 interleaved rounds" in out
    assert "now:    fastest bf16, CPU 97% of 2 threads (trusted from 80%), load 0.3 -> 0.3" in out
    assert "cached: int8/onednn, measured 2 d ago at load 0.3, CPU 97% of 2 threads" in out
    assert "-> bf16 is cached, replacing int8/onednn" in out
    assert [r["verdict"] for r in _verdicts(check.cache_dir()).values()] == ["bf16"]
    row = next(x for x in out.splitlines() if x.startswith("bf16 "))
    assert row.split()[1:4] == ["1.000", "1.000", "1.000"]  # two rounds and the best

    machine.share = 0.45  # busy: shown, but the cached verdict stays
    machine.seconds = _times(True, int8__onednn=0.3)
    machine.now += 60
    _new_process(monkeypatch)
    assert main(argv + ["--json", str(check.cache_dir() / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "now:    fastest int8/onednn, CPU 45% of 2 threads (trusted from 80%)" in out
    assert "cached: bf16, measured 1 min ago" in out
    assert "-> not cached: the machine was busy while timing: CPU 45% of 2 threads (needs 80%)" in out
    assert "the cached verdict stays (this run would use the rule of thumb, bf16)" in out
    assert [r["verdict"] for r in _verdicts(check.cache_dir()).values()] == ["bf16"]
    res = json.loads((check.cache_dir() / "bench.json").read_text())["auto"]
    assert res["trusted"] is False and res["previous"]["verdict"] == "bf16" and res["measurement"]["cpu_share"] == 0.45


def test_bench_help_documents_the_auto_part(capsys):
    from cosyllama.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "auto (time --precision auto's flow candidates again" in out and "under 80% of the CPU" in out


def test_serve_logs_the_cpu_line(monkeypatch, machine, caplog):

    from cosyllama.options import LoadOptions
    from cosyllama.server.startup import load_models

    caplog.set_level("WARNING", logger="cosyllama")
    load_models(LoadOptions(MODEL_DIR, precision="fp32"))
    said = [r.getMessage() for r in caplog.records]
    assert any(s.startswith("cpu: ") for s in said)
    assert "precision on cpu: flow fp32 (fixed by --precision); vocoder fp32 (fixed by --precision)" in said
