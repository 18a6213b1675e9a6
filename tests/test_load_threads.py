"""llama.cpp's decode threads follow the load other processes put on this process's cores
(cosyllama.llm.load_threads): the arithmetic on stand-in /proc readings and a stand-in clock, and the
readings of this machine's real /proc."""

from __future__ import annotations

import pytest

from cosyllama.llm import load_threads
from cosyllama.llm.load_threads import LoadThreads, threads_for


class FakeMachine:
    """CPU seconds of the process's cores and of the process, advanced by hand."""

    def __init__(self):
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def governor(self, most: int = 2, cores: int = 2, **kw) -> LoadThreads:
        return LoadThreads(most, cpus=frozenset(range(cores)), read_busy=lambda cpus: self.busy,
                           read_own=lambda: self.own, clock=lambda: self.t, enabled=True, **kw)


def test_threads_for_the_cores_other_work_holds():
    assert [threads_for(o, 2, 2) for o in (0.0, 0.3, 0.59, 0.6, 1.0, 1.7, 2.0)] == [2, 2, 2, 1, 1, 1, 1]
    assert [threads_for(o, 8, 4) for o in (0.0, 3.0, 4.7, 6.0, 8.0)] == [4, 4, 3, 2, 1]
    assert threads_for(-0.2, 2, 2) == 2  # a reading that went backwards by a tick


def test_a_busy_core_lowers_the_threads_and_a_quiet_one_restores_them():
    m = FakeMachine()
    g = m.governor()
    assert g.current() == 2
    m.run(0.6, own_cores=2.0, other_cores=0.0)  # decoding alone: all ours
    assert g.current() == 2
    m.run(0.6, own_cores=1.3, other_cores=0.7)  # another process takes a share of the cores
    assert g.current() == 1 and g.other_cores == pytest.approx(0.7) and g.changes == 1
    m.run(0.6, own_cores=1.0, other_cores=1.0)
    assert g.current() == 1
    m.run(0.6, own_cores=1.0, other_cores=0.1)  # it ended
    assert g.current() == 2 and g.changes == 2


def test_own_work_is_not_load_and_readings_wait_for_the_interval():
    m = FakeMachine()
    g = m.governor()
    m.run(0.6, own_cores=2.0, other_cores=0.0)  # the flow's threads and the decode's: this process's own
    assert g.current() == 2
    m.run(0.1, own_cores=0.0, other_cores=2.0)  # a blip shorter than the interval is not read yet
    assert g.current() == 2
    m.run(0.5, own_cores=2.0, other_cores=0.0)  # read over the whole 0.6 s window: 0.33 cores
    assert g.current() == 2


def test_off_by_environment_one_thread_or_no_proc(monkeypatch):
    m = FakeMachine()
    monkeypatch.setenv(load_threads.THREADS_BY_LOAD_ENV, "0")
    g = LoadThreads(2, cpus=frozenset({0, 1}), read_busy=lambda c: m.busy, read_own=lambda: m.own,
                    clock=lambda: m.t)
    m.run(1.0, own_cores=1.0, other_cores=1.0)
    assert not g.enabled and g.current() == 2
    assert not m.governor(most=1).enabled
    g = LoadThreads(2, cpus=frozenset({0, 1}), read_busy=lambda c: None, read_own=lambda: 0.0,
                    clock=lambda: m.t, enabled=True)
    m.run(1.0, own_cores=0.0, other_cores=2.0)
    assert g.current() == 2


def test_real_readings():
    import os

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc here: the threads stay as asked")
    cpus = frozenset(os.sched_getaffinity(0))
    busy, own = load_threads.read_cpu_busy(cpus), load_threads.read_own_cpu()
    assert busy is not None and own is not None and busy > 0 and own > 0
    x = 0
    for i in range(3_000_000):  # about a second of this process's own CPU
        x += i
    assert load_threads.read_own_cpu() > own
    assert load_threads.read_cpu_busy(frozenset()) == 0.0  # no CPU of ours: nothing counted


def test_apply_sets_the_context_only_when_the_count_changes():
    m = FakeMachine()
    g = m.governor()
    calls = []

    class Lib:
        def llama_set_n_threads(self, ctx, n, n_batch):
            calls.append((ctx, n, n_batch))

    assert g.apply(Lib(), "ctx", 2) == 2 and calls == []
    m.run(0.6, own_cores=1.0, other_cores=1.0)
    assert g.apply(Lib(), "ctx", 2) == 1 and calls == [("ctx", 1, 1)]
    assert g.apply(Lib(), "ctx", 1) == 1 and calls == [("ctx", 1, 1)]
