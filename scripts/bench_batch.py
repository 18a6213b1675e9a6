"""Batch throughput: `cosyllama batch`'s engine vs a loop of TTS calls, and the Ray path, on one machine.

A manifest of ``--rows`` short zero-shot rows (3 s prompt clip, seeded sampling) runs

- ``loop``: one TTS, one row after another (``tts.cross_lingual(...).audio()`` + the file write),
- ``batch``: the same loaded TTS through :class:`cosyllama.batch.BatchEngine` (``--concurrency``
  rows at once, their LLM steps batched by the scheduler),
- ``loop-thread``: the loop in one worker thread (as the engine's rows run),
- ``cli`` / ``ray``: the whole ``cosyllama batch`` command, locally / with ``--ray`` on a local Ray
  instance (one actor with all CPUs), model load (and Ray's start) included.

and reports rows/s, audio seconds per wall second and the seconds per stage summed over rows.
Default model: the full-size random-weight model (made once in ~/.cache/cosyllama, ~4 GB) with its
Q8_0 speech GGUF; random weights make noise of random length, the same rows in every mode.

    python scripts/bench_batch.py --rows 16 --threads 2 --modes loop,batch,cli,ray --json bench-batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from cosyllama.batch.engine import BatchEngine, EngineOptions, RowSynthesizer, load_tts
from cosyllama.batch.manifest import read_manifest
from cosyllama.batch.progress import STAGES
from cosyllama.options import LoadOptions
from cosyllama.precision import precision_name
from cosyllama.tools.bench_setup import ensure_full_model, ensure_gguf, machine_info, prompt_wav

TEXTS = ["Hello there.", "Good morning.", "See you soon.", "Thank you.", "Turn left here.", "It is raining.",
         "Open the door.", "What time is it?", "Not today.", "Let us go.", "Well done.", "Come back later.",
         "Good night.", "I agree.", "Very nice.", "Take care."]
PROMPT_TEXT = "This is the prompt clip."


def summarize(name: str, recs: list[dict], wall: float, load_s: float | None = None) -> dict:
    ok = [r for r in recs if r["status"] == "ok"]
    audio = sum(r["audio_seconds"] for r in ok)
    out = {"mode": name, "rows": len(ok), "failed": len(recs) - len(ok), "wall_s": round(wall, 2),
           "audio_s": round(audio, 2), "tokens": sum(r["tokens"] for r in ok),
           "rows_per_s": round(len(ok) / wall, 4), "audio_s_per_s": round(audio / wall, 4),
           "stage_s": {k: round(sum(r["seconds"][k] for r in ok), 2) for k in STAGES}}
    if load_s is not None:
        out["load_s"] = round(load_s, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="rows at a time in the cli and ray modes")
    ap.add_argument("--flow-slots", type=int, default=0,
                    help="rows in the flow at once in the cli and ray modes (0: no limit)")
    ap.add_argument("--batch-configs", default="4:0",
                    help="batch-engine runs as CONCURRENCY:FLOW_SLOTS, comma separated (default 4:0)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--modes", default="loop,batch,ray")
    ap.add_argument("--model-dir", help="default: the cached full-size random model")
    ap.add_argument("--gguf", help="default: its Q8_0 speech GGUF; 'none' runs the PyTorch LLM")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    modes = args.modes.split(",")

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = Path(args.model_dir) if args.model_dir else ensure_full_model(log)
    gguf = None if args.gguf == "none" else (args.gguf or str(ensure_gguf(model_dir, "speech", "Q8_0", log)))
    work = Path(tempfile.mkdtemp(prefix="cosyllama-bench-batch-"))
    wav = prompt_wav(3.0)
    manifest = work / "m.jsonl"
    # zero-shot: the LLM's length bound counts the row's own text tokens only (20 per token), so these
    # short texts give rows of about 1-2.5 s (random weights stop at random past the lower bound)
    manifest.write_text("".join(json.dumps({"id": f"r{i:02d}", "mode": "zero-shot", "text": TEXTS[i % len(TEXTS)],
                                            "prompt_wav": str(wav), "prompt_text": PROMPT_TEXT, "seed": i}) + "\n"
                                for i in range(args.rows)))
    rows = read_manifest(manifest).rows
    load = LoadOptions(str(model_dir), llm=None, gguf=gguf, threads=args.threads, precision=args.precision,
                       parallel=args.concurrency)
    opts = EngineOptions(load, concurrency=args.concurrency)
    results = {"machine": machine_info(args.threads), "rows": args.rows, "concurrency": args.concurrency,
               "flow_slots": args.flow_slots,
               "llm": "llamacpp Q8_0 speech" if gguf else "torch", "modes": []}

    tts = None
    if {"loop", "loop-thread", "batch"} & set(modes):
        t0 = time.perf_counter()
        tts = load_tts(opts)
        load_s = time.perf_counter() - t0
        log(f"loaded in {load_s:.1f} s (flow {precision_name(tts.token2wav.flow.precision)})")
        synth = RowSynthesizer(tts, work, "wav")
        synth.run(rows[0])  # warm-up (first-call allocations, the prompt clip's features)
    for where in [m for m in modes if m in ("loop", "loop-thread")]:
        (work / where).mkdir()
        synth = RowSynthesizer(tts, work / where, "wav")
        synth.run(rows[0])
        recs = []

        def loop():
            recs.extend(synth.run(r) for r in rows)

        t0 = time.perf_counter()
        if where == "loop":
            loop()
        else:  # in one worker thread, as the engine's rows run (torch's thread pools per calling thread)
            th = threading.Thread(target=loop)
            th.start()
            th.join()
        res = summarize("loop of TTS calls" + (" (in a worker thread)" if where == "loop-thread" else ""),
                        recs, time.perf_counter() - t0)
        results["modes"].append(res)
        log(json.dumps(res))
    for cfg in args.batch_configs.split(",") if "batch" in modes else []:
        conc, slots = (int(x) for x in cfg.split(":"))
        d = work / f"batch-{conc}-{slots}"
        d.mkdir()
        engine = BatchEngine(replace(opts, concurrency=conc, flow_slots=slots), d, models=tts.models, voices=tts.voices)
        engine.synth.run(rows[0])
        recs = []
        t0 = time.perf_counter()
        engine.run(rows, recs.append)
        name = f"batch engine, {conc} rows at a time" + (f", {slots} in the flow" if slots else "")
        res = summarize(name, recs, time.perf_counter() - t0)
        res["scheduler"] = {k: v for k, v in engine.scheduler.stats().items()
                            if k in ("steps", "tokens", "batch_sizes")}
        engine.close()
        results["modes"].append(res)
        log(json.dumps(res))
    del tts
    for mode in [m for m in modes if m in ("cli", "ray")]:  # whole commands, model load included
        out = work / mode
        cmd = [sys.executable, "-m", "cosyllama.cli", "batch", str(manifest), "--out", str(out), "--model-dir",
               str(model_dir), "--threads", str(args.threads), "--precision", args.precision,
               "--concurrency", str(args.concurrency), "--flow-slots", str(args.flow_slots), "--no-progress"]
        if mode == "ray":
            cmd += ["--ray", "--ray-actors", "1", "--ray-cpus", str(args.threads),
                    "--ray-batch-size", str(2 * args.concurrency)]
        if gguf:
            cmd += ["--gguf", gguf]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        name = ("cosyllama batch --ray (1 local actor)" if mode == "ray" else "cosyllama batch (local)")
        res = summarize(name + ", whole command incl. start + model load", recs, wall)
        results["modes"].append(res)
        log(json.dumps(res))

    print(f"\n{args.rows} rows, concurrency {args.concurrency}, {args.threads} threads, LLM {results['llm']}")
    print(f"{'mode':<64}{'rows/s':>8}{'audio-s/s':>10}{'wall s':>8}{'audio s':>8}  stage s (summed over rows)")
    for r in results["modes"]:
        st = " ".join(f"{k}={v}" for k, v in r["stage_s"].items())
        print(f"{r['mode']:<64}{r['rows_per_s']:>8.3f}{r['audio_s_per_s']:>10.3f}{r['wall_s']:>8.1f}"
              f"{r['audio_s']:>8.1f}  {st}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
