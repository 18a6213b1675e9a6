"""The timing behind ``--precision auto``: which flow path that passed the fidelity check is fastest here.

``auto`` measures instead of assuming (:func:`choose_fastest`): on the CPU it times every candidate that passed
the fidelity check (:mod:`cosyllama.flow.check`; float32, bf16 where the CPU computes it natively, int8 on each
of PyTorch's int8 engines) on a solve of :data:`TIME_PROMPT_TOKENS` + :data:`TIME_TOKENS` tokens in
:data:`TIME_ROUNDS` interleaved rounds (A B C, C B A) and keeps the fastest, so each CPU class gets the path
that is fastest there without anyone having that class at hand. A machine busy with other work cannot fool it:
where the load average is already above the cores it does not time, and a measurement during which the process
got less than :data:`CPU_SHARE_MIN` of the CPU its threads asked for is refused; either way the flow runs the
fidelity-checked rule of thumb (:func:`rule_of_thumb`), the reason says so, nothing is cached and the next start
measures again. A trusted verdict is cached beside the checks with its record (when, the load averages, the CPU
share, every round's seconds), keyed as the checks are but by the CPU's model name rather than its class, and by
the thread count and the candidates that passed. It does not expire by age (what it depends on is in its key);
the CPU line shows its age, and ``cosyllama bench --parts auto`` measures again and replaces it when that
measurement is trusted. Emulated bf16 (a CPU without AVX512-BF16/AMX) is not timed: it ran 5x slower than
float32 on AVX2 (docs/benchmarks.md), and one timed solve would cost half a minute there.
``COSYLLAMA_AUTO=rule`` skips the timing and keeps the class rule (:func:`cosyllama.precision.auto_candidate`),
as the test suite does for reproducible paths.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

from ..defaults import AUTO_CPU_SHARE_MIN
from ..timing import rounds, timed
from .check import CHECK_SEED, Candidate, CheckResult, Flow, cached, check_candidate, file_key, random_input, remember

TIME_TOKENS = 50  # the timed solve: 2 s after a 1 s prompt (150 frames: attention's share is not negligible)
TIME_PROMPT_TOKENS = 25
TIME_ROUNDS = 2  # A B C, C B A: every candidate timed twice, beside the others; its best round counts
# What the timed solve predicts: 3 s + 10 s (the benchmarks' size). A solve's attention grows with the square of
# its frames and its products linearly, so the small solve overstates a lossy path's gain wherever attention costs
# every candidate alike (AVX512-BF16 without AMX: PyTorch's flash kernel runs bf16 no faster than fp32). Each
# candidate's time is projected: its attention (timed apart, in the candidate's attention dtype, at both sizes)
# taken out, the rest scaled by the frames, the real size's attention put back. On a Zen 4 the timed fp32 /
# static int8 ratio was 3.19-3.27x against 2.44-2.64x at 3 s + 10 s, projected 2.68x (docs/precision.md). The
# attention timing (under a second) follows the rounds, outside the CPU share that decides whether they count.
REAL_PROMPT_TOKENS = 75
REAL_TOKENS = 250
# A measurement is trusted only if the process got this share of the CPU its threads asked for (CPU seconds /
# (wall seconds x threads) over the timed rounds). Quiet 2-core machines gave 0.96-0.99 at 2 threads on the
# full-size flow (docs/data/bench-flow-vocoder-avx2-idle.json, flow-candidates-mixed-amx.json); one busy thread
# beside 2 threads on 2 cores leaves at most 2/3 (0.67), two leave 1/2.
CPU_SHARE_MIN = AUTO_CPU_SHARE_MIN
# Not timed at all when the 1-minute load average exceeds the cores (or the threads, where more) by this much:
# other work then wants a core the timing needs, and the numbers would be refused anyway.
LOAD_SLACK = 1.0
# A lossy candidate (bf16, int8) replaces float32 only when its timed solve is at least this much faster (float32's
# best round over its own, the rounds interleaved). Why a margin, and this one: the timed solve (25 + 50 tokens)
# is small, and at real sizes attention, which every candidate computes in float, takes a larger share, so it
# can overstate a lossy path's gain: on an AVX2 Zen 1 int8 timed 1.28x fp32 here but 1.11x at a real size, and
# the whole synthesis then ran at RTF 15.85 against fp32's 15.31, using 0.5 GB more (its weight copies and
# quantization passes compete with the LLM for memory bandwidth). 1.3x keeps the exact path there; where int8
# really is faster it passes by far (AVX2 on a Zen 3/4 core: 1.71x timed, 1.83x at 75 + 150 tokens;
# docs/benchmarks.md#auto-on-the-avx2-class), as do bf16 and int8 on AVX512-BF16 (2.3x, 3.4x).
LOSSY_MIN_GAIN = 1.3
# The mixed int8 path with dynamic activation scales (int8/onednn+bf16) replaces its static twin (the same path with
# calibrated scales, when that passed its check) only when it is at least this much faster. The static one does a
# subset of the dynamic one's work (no range pass, GELU and requantization inside the products), and the timed
# solve cannot tell them apart where it is dominated by fixed costs: on a Zen 4, 2 threads, they timed 2.54 and
# 2.56 s at 25 + 50 tokens while at 3 s + 10 s static ran 1.28x faster (1.082 against 1.382 s per audio second)
# and a warmed voice's first streamed chunk 1.16x (1.60 against 1.87 s; docs/benchmarks.md).
DYNAMIC_MIN_GAIN = 1.1
STATIC_SUFFIX = "+static"
VERDICT_VERSION = 4  # bump when the record's meaning changes: older verdicts are measured again
AUTO_ENV = "COSYLLAMA_AUTO"  # "measure" (default) or "rule"


def candidates(flow: Flow) -> list[Candidate]:
    """What ``auto`` times on this flow's device, float32 first (docstring: emulated bf16 is left out)."""
    from ..precision import INT8, cpu_has_native_bf16
    from .fast_dit import INT8_ENGINES, int8_engine_problem

    out = [Candidate(torch.float32)]
    if flow.device.type != "cpu":
        return out
    if cpu_has_native_bf16():
        out.append(Candidate(torch.bfloat16))
    out += [Candidate(INT8, e) for e in INT8_ENGINES if int8_engine_problem(e) is None]
    return out


def timing_input(flow: Flow) -> tuple[torch.Tensor, ...]:
    """The timed solve's input: like :func:`~cosyllama.flow.check.synthetic_input`, :data:`TIME_PROMPT_TOKENS` +
    :data:`TIME_TOKENS`."""
    return random_input(flow, CHECK_SEED + 1, TIME_PROMPT_TOKENS, TIME_TOKENS)


# The seams of the measurement (tests replace them: a mocked clock, load and CPU-time gap, no real races).
_clock = time.time  # when a verdict was measured (seconds since the epoch)


def _loadavg() -> tuple[float, float, float] | None:
    """The machine's 1-, 5- and 15-minute load averages (None where the OS has none, e.g. Windows)."""
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):
        return None


def _cores() -> int:
    """The machine's CPUs, as the load average counts them (all of them, not this process's affinity)."""
    return os.cpu_count() or 1


def _solve(flow: Flow, cand: Candidate, inp: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """Wall and process CPU seconds of one solve of ``inp`` on ``cand`` (the flow is left on it)."""
    cand.apply(flow)
    wall, cpu, _ = timed(lambda: flow.inference(*inp), flow.device)
    return wall, cpu


def _attention_call(frames: int, heads: int, dim_head: int, dtype: torch.dtype, reps: int = 3) -> float:
    """Best-of-``reps`` seconds of one whole-call attention over ``frames`` frames, both CFG rows, as the
    solver runs it: in bf16 on the attention chosen for this CPU (the bf16 kernel or PyTorch's with its keys
    padded, :mod:`cosyllama.flow.native_attention`), in float32 on PyTorch's."""
    import torch.nn.functional as F

    if dtype == torch.bfloat16:
        from . import native_attention

        which = "kernel" if native_attention.choice(heads, dim_head).kernel else "pytorch"
        return native_attention.timed_calls(frames, heads, dim_head, reps, (which,))[which]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, frames, dim_head, generator=g).to(dtype) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v)  # warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v)
        best = min(best, time.perf_counter() - t0)
    return best


def attention_seconds(flow: Flow, cands: list[Candidate]) -> tuple[dict[str, list[float]], float] | None:
    """Per candidate the seconds a solve spends in attention at the timed size and at the real size
    (:data:`REAL_PROMPT_TOKENS` + :data:`REAL_TOKENS`), and the ratio of their frames; None off the CPU
    or where the flow's shapes cannot be read."""
    if flow.device.type != "cpu":
        return None
    try:
        blocks = flow.decoder.estimator.transformer_blocks
        attn = blocks[0].attn
        heads, dim_head = attn.heads, attn.to_q.out_features // attn.heads
        ratio, steps = flow.cfg.token_mel_ratio, flow.decoder.n_timesteps
    except (AttributeError, IndexError, TypeError):
        return None
    small, real = ratio * (TIME_PROMPT_TOKENS + TIME_TOKENS), ratio * (REAL_PROMPT_TOKENS + REAL_TOKENS)
    calls = len(blocks) * steps
    per = {dt: [calls * _attention_call(n, heads, dim_head, dt) for n in (small, real)]
           for dt in {c.attention_dtype for c in cands}}
    return {c.name: per[c.attention_dtype] for c in cands}, real / small


_attention_seconds = attention_seconds  # a seam (tests: None, no projection, or given seconds)


def busy_before_timing(threads: int) -> str | None:
    """Why the machine is too busy to time on at all (None: time, the CPU share then decides): the
    1-minute load average, which counts every runnable thread of the machine (this process's own
    included), above the cores, or the threads asked for where more, by over :data:`LOAD_SLACK`."""
    load = _loadavg()
    if load is None:
        return None
    cores = _cores()
    limit = max(cores, threads) + LOAD_SLACK
    if load[0] > limit:
        return f"the machine was busy: load average {load[0]:.1f} on {cores} cores (needs <= {limit:g}) before timing"
    return None


@dataclass(frozen=True)
class Measurement:
    """One timing of the candidates in interleaved rounds: per candidate the seconds of each round (its
    best is its time), the order they ran in, and what the process got of the CPU meanwhile: CPU seconds
    over wall seconds x threads (``cpu_share``, 1.0: every thread ran all the time) and the machine's
    load averages before and after. ``measured_at``: seconds since the epoch."""

    rounds: dict[str, list[float]]
    order: list[str]
    cpu_share: float
    threads: int
    cores: int
    wall_s: float
    measured_at: float
    load_before: tuple[float, ...] | None = None
    load_after: tuple[float, ...] | None = None
    attention: dict[str, list[float]] | None = None  # per candidate: attention seconds at the timed, real size
    scale: float | None = None  # the real size's frames over the timed solve's

    @property
    def seconds(self) -> dict[str, float]:
        return {n: min(rs) for n, rs in self.rounds.items()}

    @property
    def projected(self) -> dict[str, float]:
        """Each candidate's seconds projected to the real size (see :data:`REAL_TOKENS`): its timed
        attention out, the rest scaled by the frames, the real size's attention in. The timed seconds
        where the measurement has no attention timings."""
        s = self.seconds
        if not self.attention or not self.scale or set(self.attention) != set(s):
            return s
        return {n: max(t - self.attention[n][0], 0.0) * self.scale + self.attention[n][1] for n, t in s.items()}

    def contention(self) -> str | None:
        """Why these timings cannot be trusted (None: they can): the process got less than
        :data:`CPU_SHARE_MIN` of the CPU its threads asked for."""
        if self.cpu_share < CPU_SHARE_MIN:
            return (f"the machine was busy while timing: CPU {self.cpu_share:.0%} of {self.threads} threads "
                    f"(needs {CPU_SHARE_MIN:.0%}){_load_words(self.load_before, self.cores, ', ')}")
        return None

    def record(self, verdict: str) -> dict:
        """The cache's record of a trusted measurement (JSON)."""
        d = asdict(self)
        d["verdict"] = verdict
        d["seconds"] = self.seconds
        return d

    @classmethod
    def from_record(cls, d: dict) -> Measurement:
        """The measurement of a cached record (raises AttributeError, KeyError, TypeError or ValueError for a
        record of another shape)."""
        rounds_ = {str(n): [float(x) for x in rs] for n, rs in d["rounds"].items()}
        if not rounds_ or any(not rs for rs in rounds_.values()):
            raise ValueError("a record without timings")
        loads = [tuple(float(x) for x in d[k]) if d.get(k) else None for k in ("load_before", "load_after")]
        att = d.get("attention")
        att = {str(n): [float(x) for x in a] for n, a in att.items()} if att else None
        scale = float(d["scale"]) if d.get("scale") else None
        return cls(rounds_, [str(n) for n in d["order"]], float(d["cpu_share"]), int(d["threads"]), int(d["cores"]),
                   float(d["wall_s"]), float(d["measured_at"]), *loads, att, scale)

    def conditions(self) -> str:
        """``load 0.4, CPU 97% of 2 threads``: the load average when it started and the CPU it got."""
        load = f"load {self.load_before[0]:.1f}, " if self.load_before else ""
        return f"{load}CPU {self.cpu_share:.0%} of {self.threads} threads"


def _load_words(load, cores: int, lead: str = "") -> str:
    return f"{lead}load average {load[0]:.1f} on {cores} cores" if load else ""


def measure(flow: Flow, cands: list[Candidate], repeat: int = TIME_ROUNDS) -> Measurement:
    """Time ``cands`` on :func:`timing_input`: each solved once untimed (kernels chosen, buffers sized),
    then ``repeat`` interleaved rounds (A B C, C B A, ...: :func:`~cosyllama.timing.rounds`), so a machine
    that slows down or speeds up moves every candidate alike; a candidate's time is its best round. The
    process's CPU time over the rounds says whether it got the CPU its threads asked for."""
    inp = timing_input(flow)
    threads = torch.get_num_threads()
    load_before = _loadavg()
    for cand in cands:
        _solve(flow, cand, inp)  # warm
    by_name = {c.name: c for c in cands}
    times: dict[str, list[float]] = {c.name: [] for c in cands}
    order, wall, cpu = [], 0.0, 0.0
    for name in rounds(list(by_name), repeat):
        w, c = _solve(flow, by_name[name], inp)
        times[name].append(w)
        order.append(name)
        wall, cpu = wall + w, cpu + c
    share = cpu / (wall * threads) if wall > 0 else 0.0
    load_after = _loadavg()
    att = _attention_seconds(flow, cands)
    return Measurement(times, order, round(share, 4), threads, _cores(), round(wall, 4), _clock(), load_before,
                       load_after, *(att or (None, None)))


def _verdict_key(flow: Flow, cands: list[Candidate]) -> str | None:
    """The cache key of a verdict: the weight file's and machine's timing key, the threads and which
    candidates passed the check (a new candidate or another thread count measures again)."""
    key = file_key(flow, Candidate(torch.float32), what="auto")
    if key is None:
        return None
    from . import fast_dit

    scheme = (fast_dit.INT8_REDUCE_RANGE, fast_dit.INT8_WEIGHT_MAX, fast_dit.INT8_FP32_LAST_STEPS)
    return "|".join([key, f"threads={torch.get_num_threads()}", ",".join(c.name for c in cands), str(scheme),
                     f"attention={_bf16_attention(flow)}", f"v{VERDICT_VERSION}"])


def _bf16_attention(flow: Flow) -> str:
    """Which bf16 attention the flow's bf16 and mixed candidates run on this CPU (``kernel`` or ``pytorch``,
    cosyllama.flow.native_attention): a verdict timed with one says nothing about the other."""
    from . import native_attention

    c = native_attention.for_flow(flow)
    return "kernel" if c is not None and c.kernel else "pytorch"


def cached_verdict(flow: Flow, cands: list[Candidate]) -> tuple[str, Measurement] | None:
    """The cached verdict of this flow's weight file on this machine and thread count with ``cands``
    passing the check: the chosen candidate's name and its measurement; None where there is none."""
    rec = cached(_verdict_key(flow, cands))
    if not rec:
        return None
    try:
        m = Measurement.from_record(rec)
        verdict = str(rec["verdict"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return None  # a record of another shape: measure again
    if verdict not in {c.name for c in cands} or set(m.rounds) != {c.name for c in cands}:
        return None
    return verdict, m


def format_age(seconds: float) -> str:
    """``40 s``, ``12 min``, ``5 h``, ``3 d``."""
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit}"
    return f"{s:.0f} s"


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose: the candidate, its fidelity check (None for float32), the timings of every
    candidate that passed (name -> seconds; empty where nothing was timed), and the candidates that
    failed the check. ``source``: ``measured`` (timed now and cached), ``cached`` (a verdict measured
    earlier) or ``rule`` (the rule of thumb, because the machine was busy: ``busy`` says why; nothing
    cached). ``measurement``: the timing behind it (the cached one for ``cached``; for ``rule`` the one
    refused, None where the load kept it from timing at all)."""

    chosen: Candidate
    check: CheckResult | None
    seconds: dict[str, float]
    failed: tuple[CheckResult, ...] = ()
    source: str = "measured"
    measurement: Measurement | None = None
    busy: str | None = None
    previous: tuple[str, Measurement] | None = None  # with ``remeasure``: the verdict cached before
    checks: tuple[CheckResult, ...] = ()  # every candidate's check that passed

    @property
    def projected(self) -> dict[str, float]:
        """The measurement's seconds projected to the real size (:attr:`Measurement.projected`; empty without one)."""
        return self.measurement.projected if self.measurement is not None else {}

    @property
    def cached(self) -> bool:
        """The verdict was measured earlier (``source`` ``cached``)."""
        return self.source == "cached"

    def age(self, now: float | None = None) -> float | None:
        """Seconds since the measurement behind the verdict (None where there was none)."""
        if self.measurement is None:
            return None
        return (_clock() if now is None else now) - self.measurement.measured_at

    def summary(self, now: float | None = None) -> str:
        t = ", ".join(f"{n} {s:.2f} s" for n, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        m = self.measurement
        if self.source == "rule":
            out = (f"{self.busy}; not cached, measures again on the next start"
                   + (f"; timings under load on {TIME_PROMPT_TOKENS}+{TIME_TOKENS} tokens: {t}" if t else ""))
        else:
            when = "measured now" if self.source == "measured" else f"measured {format_age(self.age(now))} ago"
            out = f"{when} at {m.conditions()} on {TIME_PROMPT_TOKENS}+{TIME_TOKENS} tokens: {t}"
        if self.failed:
            out += "; failed the fidelity check: " + ", ".join(f.summary() for f in self.failed)
        p, exact = self.projected, Candidate(torch.float32).name
        if p and self.source != "rule" and exact in p and self.chosen.name != exact:
            out += (f"; projected to {REAL_PROMPT_TOKENS}+{REAL_TOKENS} tokens: fp32 / {self.chosen.name} "
                    f"{p[exact] / p[self.chosen.name]:.2f}x")
        if self.check is not None:
            out += f"; {self.check.summary()}"
        return out

    def reason(self, now: float | None = None) -> str:
        """The CPU line's words for this choice."""
        if self.source == "rule":
            return f"auto: rule of thumb, {rule_words(self.chosen)}, because {self.summary(now)}"
        by = self.projected or self.seconds
        if by and by.get(self.chosen.name, 0.0) > min(by.values()):
            if self.chosen.dtype == torch.float32:
                return f"auto: fp32 kept, no lossy path is {LOSSY_MIN_GAIN}x faster here, {self.summary(now)}"
            return (f"auto: static scales kept, their dynamic twin is not {DYNAMIC_MIN_GAIN}x faster here, "
                    f"{self.summary(now)}")
        return f"auto: fastest here, {self.summary(now)}"


def verdict(seconds: dict[str, float], by_name: dict[str, Candidate]) -> Candidate:
    """The fastest of the timed candidates, float32 unless a lossy one is :data:`LOSSY_MIN_GAIN` times faster, and
    a static-scale twin rather than its dynamic path unless that is :data:`DYNAMIC_MIN_GAIN` times faster."""
    exact = Candidate(torch.float32).name
    fast = [n for n, t in seconds.items() if n == exact or seconds[exact] >= LOSSY_MIN_GAIN * t]
    best = min(fast, key=seconds.get)
    twin = best + STATIC_SUFFIX
    if twin in fast and seconds[twin] < DYNAMIC_MIN_GAIN * seconds[best]:
        best = twin
    return by_name[best]


def rule_of_thumb(flow: Flow, passed: list[Candidate]) -> Candidate:
    """What ``auto`` runs when it cannot measure: this device's class rule
    (:func:`cosyllama.precision.auto_candidate`: bf16 where native, int8 on PyTorch's default engine on
    other x86 CPUs) if that candidate passed the fidelity check, else float32."""
    from ..precision import auto_candidate
    from .fast_dit import INT8_ENGINE

    want = auto_candidate(flow.device)
    for c in passed:
        if c.dtype == want and (c.int8_engine or INT8_ENGINE) == INT8_ENGINE:
            return c
    return Candidate(torch.float32)


def rule_words(cand: Candidate) -> str:
    if cand.dtype == torch.bfloat16:
        return "bf16 where the CPU computes it natively"
    if cand.dtype == torch.float32:
        return "fp32 (no faster candidate passed the fidelity check)"
    return f"{cand.name} where bf16 is not native"


def choose_fastest(flow: Flow, remeasure: bool = False) -> AutoChoice:
    """Check every :func:`candidates` entry's fidelity, then take the cached verdict of this weight file,
    machine and thread count or, without one, time those that pass and float32 (:func:`measure`) and leave
    the flow on the fastest. A measurement the machine disturbed (the load before it, or the CPU share
    during it: :func:`busy_before_timing`, :meth:`Measurement.contention`) is not cached: the flow then
    runs the :func:`rule_of_thumb` and the next start measures again. ``remeasure``: ignore the cached
    verdict and the load before timing (``cosyllama bench --parts auto``); a trusted result replaces the
    cached one."""
    checks: dict[str, CheckResult] = {}
    failed = []
    passed: list[Candidate] = []
    reference: dict = {}  # the float32 solve of the check's input, made at most once
    for cand in candidates(flow):
        if cand.dtype != torch.float32:
            res = check_candidate(flow, cand, reference)
            if not res.passed:
                failed.append(res)
                continue
            checks[cand.name] = res
        passed.append(cand)
    by_name = {c.name: c for c in passed}

    def done(chosen: Candidate, **kw) -> AutoChoice:
        chosen.apply(flow)
        m = kw.get("measurement")
        return AutoChoice(chosen, checks.get(chosen.name), m.seconds if m else {}, tuple(failed),
                          checks=tuple(checks.values()), **kw)

    key = _verdict_key(flow, passed)
    hit = cached_verdict(flow, passed)
    if not remeasure:
        if hit is not None:
            return done(by_name[hit[0]], source="cached", measurement=hit[1])
        busy = busy_before_timing(torch.get_num_threads())
        if busy:
            return done(rule_of_thumb(flow, passed), source="rule", busy=busy)
    previous = hit if remeasure else None
    m = measure(flow, passed)
    busy = m.contention()
    if busy:
        return done(rule_of_thumb(flow, passed), source="rule", measurement=m, busy=busy, previous=previous)
    best = verdict(m.projected, by_name)
    if key is not None:
        rec = m.record(best.name)
        remember(key, rec)
    return done(best, source="measured", measurement=m, previous=previous)


__all__ = ["AUTO_ENV", "CPU_SHARE_MIN", "LOAD_SLACK", "LOSSY_MIN_GAIN", "REAL_PROMPT_TOKENS", "REAL_TOKENS",
           "TIME_PROMPT_TOKENS", "TIME_ROUNDS", "TIME_TOKENS", "AutoChoice", "Measurement", "attention_seconds",
           "busy_before_timing", "cached_verdict", "candidates",
           "choose_fastest", "format_age", "measure", "rule_of_thumb", "rule_words", "timing_input", "verdict"]
