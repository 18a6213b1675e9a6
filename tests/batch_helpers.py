"""What the batch tests share: a manifest written, ``results.jsonl`` read by row id, ``cosyllama batch`` run on
the tiny model (fp32, no progress bar)."""

from __future__ import annotations

import json

from cosyllama.cli import main
from helpers import MODEL_DIR


def write_manifest(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def results(out_dir) -> dict:
    """Each row's result line, by its id."""
    return {r["id"]: r for r in map(json.loads, (out_dir / "results.jsonl").read_text().splitlines())}


def run_batch(manifest, out_dir, *extra) -> int:
    return main(["batch", str(manifest), "--out", str(out_dir), "--model-dir", str(MODEL_DIR),
                 "--precision", "fp32", "--no-progress", *extra])
