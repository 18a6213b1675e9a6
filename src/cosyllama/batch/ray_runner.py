"""``cosyllama batch --ray``: the same job on Ray Data.

The rows still to do become a dataset; ``map_batches`` hands them, a batch at a time, to a fixed
pool of actors. Each actor loads the model once (:class:`~cosyllama.batch.engine.BatchEngine`,
with its own batching scheduler), synthesizes its batch's rows concurrently, writes their audio
files atomically into the output directory (a path every node sees) and returns one result record
per row. The driver appends the records to ``results.jsonl`` as batches come back, so resume and
per-row errors behave exactly as in the local mode; a batch lost with its actor is simply not
recorded and runs again next time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import CosyllamaError, MissingDependencyError
from .engine import EngineOptions, error_record
from .manifest import Row


class RayJobError(CosyllamaError, RuntimeError):
    """Ray could not be reached, or the job failed outside any one row (an actor could not load
    the model, a node died); the rows recorded so far are kept."""


INSTALL_HINT = "--ray needs Ray Data: pip install 'cosyllama[ray]' (or pip install 'ray[data]')"


def import_ray():
    try:
        import ray
        import ray.data  # noqa: F401  (the [data] extra)
    except ImportError as e:
        raise MissingDependencyError(f"{INSTALL_HINT} ({e})") from None
    return ray


class RowActor:
    """A Ray Data actor: one model, many batches of rows."""

    def __init__(self, opts: EngineOptions, out_dir: str):
        from .engine import BatchEngine

        self.engine = BatchEngine(opts, Path(out_dir))

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        rows = [Row.from_json(s) for s in batch["row"]]
        recs: dict[str, dict] = {}
        self.engine.run(rows, lambda rec: recs.__setitem__(rec["id"], rec))
        # a row without a record was cancelled: not "failed", so the next run makes it
        out = [recs.get(r.id) or error_record(r.id, r.line, "cancelled", "cancelled", r.digest) for r in rows]
        return {"result": np.array([json.dumps(rec, ensure_ascii=False) for rec in out], dtype=object)}


def run_on_ray(address: str | None, rows: list[Row], opts: EngineOptions, out_dir: Path,
               on_result: Callable[[dict], None], *, actors: int = 1, cpus: float = 1.0, gpus: float = 0.0,
               batch_size: int = 8, err=sys.stderr) -> None:
    """Run ``rows`` on a Ray cluster (``address``; None: RAY_ADDRESS or a new local instance)."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=True)
        except Exception as e:
            where = f"the Ray cluster at {address!r}" if address else "Ray"
            raise RayJobError(f"cannot start or reach {where}: {type(e).__name__}: {e}") from None
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours shows rows and audio seconds
        if hasattr(ctx, "print_on_execution_start"):
            ctx.print_on_execution_start = False
        res = ray.cluster_resources()
        print(f"ray: {actors} actor(s) x {cpus:g} CPU{f' + {gpus:g} GPU' if gpus else ''}, {batch_size} rows per "
              f"batch; cluster has {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU", file=err)
        ds = ray.data.from_items([{"row": r.to_json()} for r in rows])
        ds = ds.map_batches(RowActor, fn_constructor_kwargs={"opts": opts, "out_dir": str(out_dir)},
                            batch_size=batch_size, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus, num_gpus=gpus)
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for s in batch["result"]:
                    on_result(json.loads(s))
        except ray.exceptions.RayError as e:
            first = str(e).strip().splitlines()
            raise RayJobError(f"the Ray job failed: {type(e).__name__}: {first[-1] if first else ''} "
                              "(rows finished so far are recorded; run again to continue)") from e
    finally:
        if started:
            ray.shutdown()
