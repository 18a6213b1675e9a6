"""How cosyllama times things, in one place: one call's wall and process CPU time with CUDA work waited
for on both sides (:func:`timed`), configurations timed in interleaved rounds (:func:`rounds`), the
best of repeated calls (:func:`best_of`). Used by ``cosyllama bench``, ``--precision auto``'s timing of
the flow (:mod:`cosyllama.flow.auto`) and the bench scripts; what they time on is in
:mod:`cosyllama.tools.bench_setup`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op but on CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[float, float, T]:
    """``(wall seconds, process CPU seconds, fn())`` of one call, the device's earlier work finished
    before the clock starts and ``fn``'s own before it stops."""
    sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, out


def rounds(items: list, repeat: int) -> list:
    """``items`` in ``repeat`` interleaved rounds, every other one reversed (A B C, C B A, ...): each
    row is timed beside the others, so a machine that slows down or speeds up during the run moves
    every row alike and the ratios between rows stay readable (the medians of the rounds are
    reported)."""
    return [x for r in range(repeat) for x in (items if r % 2 == 0 else items[::-1])]


def best_of(fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu") -> float:
    """The fastest wall seconds of ``repeats`` calls of ``fn``, after one untimed warm-up call (for
    micro-benchmarks of one kernel; a whole stage is timed in :func:`rounds` and reported as medians)."""
    fn()
    return min(timed(fn, device)[0] for _ in range(repeats))
