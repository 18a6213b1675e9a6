"""Threads for llama.cpp's decoding, lowered while other processes keep this process's cores busy.

Why: each ``llama_decode`` is a few hundred operators, and ggml's worker threads meet at a barrier
after each one, spinning until every thread has arrived (an OpenMP build's barrier spins the same
way). When another process holds one of two cores, one of the decode's two threads keeps losing its
core for a whole scheduler slice, and its partner spins at every barrier until it is back: speech
Q8_0 fell from ~23 to 2.4 tok/s on 2 AVX2 cores beside one busy process. One thread has no barrier to
wait at and gets the free core to itself (docs/benchmarks.md#decoding-on-a-busy-machine).

How: before a decode, at most every ``interval`` seconds, the CPU time the machine spent on this
process's cores (``/proc/stat``, the CPUs in its affinity mask; time stolen by a hypervisor counts as
busy) is compared with the CPU time this process used (``/proc/self/stat``, all its threads). The
difference, per second, is the cores other work holds; the decode gets the cores left, rounded with
a margin (:data:`HOLD_MARGIN`), between 1 and the threads asked for. The process's own work (the
flow's PyTorch threads in a server) is not "other": the scheduler already shares the cores between
the stages (``cpu.interleave_stages``). Where ``/proc`` is missing (macOS, Windows) nothing changes.
``COSYLLAMA_LLAMA_THREADS_BY_LOAD=0`` keeps the threads asked for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

THREADS_BY_LOAD_ENV = "COSYLLAMA_LLAMA_THREADS_BY_LOAD"
INTERVAL_S = 0.5  # how often the load is read (a window shorter than ~0.2 s holds too few 10 ms ticks)
# Other work counts as holding a core from 0.6 of one on: a process that keeps a core 60 % busy already
# makes the decode's barriers wait on most steps, while brief blips (a shell, a log rotation) stay below.
HOLD_MARGIN = 0.4
# /proc/stat columns after the name: user nice system idle iowait irq softirq steal (guest time is in user)
_IDLE_COLUMNS = (3, 4)


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def read_cpu_busy(cpus: frozenset[int]) -> float | None:
    """Seconds the CPUs ``cpus`` spent busy since boot (everything but idle and iowait), or None."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            if int(name[3:]) not in cpus:
                continue
        except ValueError:
            continue
        cols = [int(v) for v in rest.split()[:8]]
        busy += sum(v for i, v in enumerate(cols) if i not in _IDLE_COLUMNS)
    return busy / _ticks()


def read_own_cpu() -> float | None:
    """CPU seconds this process has used (user + system, all threads), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _ticks()  # utime, stime (fields 14 and 15 of proc(5))


def threads_for(other_cores: float, cores: int, most: int) -> int:
    """The decode's threads when other work holds ``other_cores`` of this process's ``cores``."""
    held = int(max(0.0, other_cores) + HOLD_MARGIN)
    return max(1, min(most, cores - held))


class LoadThreads:
    """The thread count a decode should use now (:meth:`current`), for at most ``most`` threads.

    ``read_busy`` / ``read_own`` / ``clock`` stand in for ``/proc`` and the clock in tests."""

    def __init__(self, most: int, interval: float = INTERVAL_S, cpus: frozenset[int] | None = None,
                 read_busy: Callable[[frozenset[int]], float | None] = read_cpu_busy,
                 read_own: Callable[[], float | None] = read_own_cpu,
                 clock: Callable[[], float] = time.monotonic, enabled: bool | None = None):
        self.most = max(1, int(most))
        self.interval = interval
        self.cpus = frozenset(os.sched_getaffinity(0)) if cpus is None else frozenset(cpus)
        self._read_busy, self._read_own, self._clock = read_busy, read_own, clock
        if enabled is None:
            enabled = os.environ.get(THREADS_BY_LOAD_ENV, "").strip().lower() not in ("0", "off", "false", "no")
        self.enabled = enabled and self.most > 1
        self.threads = self.most
        self.other_cores = 0.0  # the last measurement, for logs and benchmarks
        self.changes = 0  # how often the count changed (tests, benchmarks)
        self._last = self._sample() if self.enabled else None

    def _sample(self) -> tuple[float, float, float] | None:
        busy, own = self._read_busy(self.cpus), self._read_own()
        if busy is None or own is None:
            return None
        return self._clock(), busy, own

    def apply(self, lc, ctx, applied: int) -> int:
        """Set llama.cpp context ``ctx`` (module ``lc``) to :meth:`current` threads where it runs ``applied`` now;
        returns the count it runs now. Called before each ``llama_decode``."""
        n = self.current()
        if n != applied:
            lc.llama_set_n_threads(ctx, n, n)
        return n

    def current(self) -> int:
        """Threads for the next decode; reads the load when the last reading is ``interval`` old."""
        if not self.enabled or self._last is None:
            return self.threads
        t0, busy0, own0 = self._last
        if self._clock() - t0 < self.interval:
            return self.threads
        now = self._sample()
        if now is None:
            return self.threads
        t1, busy1, own1 = now
        self._last = now
        self.other_cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9))
        n = threads_for(self.other_cores, len(self.cpus), self.most)
        if n != self.threads:
            self.threads, self.changes = n, self.changes + 1
        return self.threads
