"""``cosyllama bench``: LLM, flow, vocoder and whole-pipeline speed, side by side in one run.

Without ``--model-dir`` it uses the full-size random-weight model (:mod:`.bench_setup`: real
Fun-CosyVoice3-0.5B shapes, so real speed; the audio is noise), made once with its GGUFs.
Generation length is forced (stop ids masked) so every configuration does equal work:
a 3 s prompt and 10 s of output unless told otherwise. ``rtf`` = wall seconds / audio seconds,
25 speech tokens = 1 s of audio. Pipeline runs happen in child processes so each has its own
peak RSS.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..progress import LineProgress as Progress
from ..timing import rounds
from .bench_flow import batch_sizes, flow_variants, format_lines, run_flow_batch, run_flow_vocoder, vocoder_variants
from .bench_setup import BENCH_TEXT, TOKEN_RATE, ensure_full_model, ensure_gguf, machine_info, peak_rss_mb, prompt_wav

LLM_TYPES = ("F16", "Q8_0", "Q4_K_M", "Q4_0")  # Q4_0: llama.cpp repacks it for its fastest CPU kernels
LLM_CONFIGS = [("torch", None, "F32")] + [("llamacpp", lay, t) for lay in ("speech", "merged") for t in LLM_TYPES]
# (LLM backend, GGUF layout, GGUF type, flow precision): the all-reference path, then the product default
PIPELINE_CONFIGS = [("torch", None, None, "fp32"), ("llamacpp", "speech", "Q8_0", "fp32"),
                    ("llamacpp", "speech", "Q8_0", "auto")]
PARTS = ("llm", "flow", "vocoder", "pipeline", "flow-batch", "auto")  # flow-batch, auto: opt-in (not in the default)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return _median(xs) if xs else None


# ----------------------------------------------------------------------------------------------
# LLM stage


def _llm_prefill(cfg, prompt_tokens: int):
    from ..llm.backend import Prefill
    from ..text.tokenizer import ENDOFPROMPT_ID

    rng = np.random.default_rng(1)
    text = [int(x) for x in rng.integers(100, 1000, 40)]
    text.insert(10, ENDOFPROMPT_ID)
    speech = tuple(int(x) for x in rng.integers(0, cfg.speech_token_size, prompt_tokens))
    return Prefill(tuple(text), speech), 30


def bench_llm_backend(backend, prompt_tokens: int, decode_tokens: int, repeat: int) -> dict:
    from ..llm.decode import DecodeOptions, generate

    prefill, n_text = _llm_prefill(backend.cfg, prompt_tokens)
    opts = DecodeOptions(greedy=True, ignore_stop=True, max_len=decode_tokens)
    list(generate(backend, prefill, n_text, DecodeOptions(greedy=True, ignore_stop=True, max_len=4)))  # warm up
    walls, decodes = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        it = generate(backend, prefill, n_text, opts)
        next(it)
        t1 = time.perf_counter()
        n = 1 + sum(1 for _ in it)
        t2 = time.perf_counter()
        assert n == decode_tokens, n
        walls.append(t2 - t0)
        decodes.append((n - 1) / (t2 - t1))
    wall = _median(walls)
    return {"prefill_tokens": len(prefill), "decode_tokens": decode_tokens, "tokens_per_s": _median(decodes),
            "rtf": wall / (decode_tokens / TOKEN_RATE), "wall_s": wall}


def llamacpp_gpu_layers(device: torch.device, progress: Progress) -> int:
    """Layers llama.cpp offloads when the bench runs on ``device``: all of them on CUDA when this
    llama-cpp-python build supports it; else 0, and the progress line says so (rows say "cpu")."""
    if device.type != "cuda":
        return 0
    from ..llm.llamacpp_backend import import_llama_cpp

    if import_llama_cpp().llama_supports_gpu_offload():
        return 999
    progress("this llama-cpp-python build has no GPU support: its rows run on the CPU")
    return 0


def run_llm(model_dir: Path, threads: int, prompt_s: float, output_s: float, repeat: int, progress: Progress,
            configs=LLM_CONFIGS, device: torch.device = torch.device("cpu")) -> list[dict]:
    from ..config import load_config

    cfg = load_config(model_dir)
    rows = []
    gpu_layers = None
    if device.type == "cuda" and ("torch", None, "F32") in configs:
        configs = [*configs, ("torch", None, "BF16")]  # the GPU's fast torch path beside the parity one
    for backend_name, layout, type_name in configs:
        label = f"{backend_name} {layout or ''} {type_name}".replace("  ", " ")
        if backend_name == "torch":
            from ..llm.factory import make_llm

            # on CUDA: the static-cache backend, its decode steps replayed as CUDA graphs
            llm_precision = {"F32": "fp32", "BF16": "bf16"}[type_name]
            backend = make_llm(cfg, "torch", device=device, n_seq_max=1, llm_precision=llm_precision)
            where = device.type
        else:
            from ..llm.llamacpp_backend import LlamaCppLLM

            if gpu_layers is None:
                gpu_layers = llamacpp_gpu_layers(device, progress)
            backend = LlamaCppLLM(ensure_gguf(model_dir, layout, type_name, progress), cfg, n_threads=threads,
                                  n_seq_max=1, n_gpu_layers=gpu_layers)
            where = "cuda" if gpu_layers else "cpu"
        progress(f"llm: {label} ({where})")
        r = bench_llm_backend(backend, round(prompt_s * TOKEN_RATE), round(output_s * TOKEN_RATE), repeat)
        rows.append({"backend": backend_name, "layout": layout, "type": type_name, "device": where, **r})
        progress(f"  {r['tokens_per_s']:.1f} tok/s, LLM RTF {r['rtf']:.3f}")
        if hasattr(backend, "close"):
            backend.close()
        del backend
        gc.collect()
    return rows


# ----------------------------------------------------------------------------------------------
# auto's verdict, measured again


def run_auto(model_dir: Path, progress: Progress, device: torch.device = torch.device("cpu")) -> dict:
    """``--parts auto``: ``--precision auto``'s measurement of the flow candidates, taken again now
    whatever is cached and whatever the load (:func:`cosyllama.flow.auto.choose_fastest` with
    ``remeasure``), beside the verdict cached before; a trusted measurement replaces that verdict."""
    from ..flow import Flow, auto

    if device.type != "cpu":
        raise InputError("--parts auto measures the flow candidates on the CPU; on a GPU, auto is bf16 where the "
                         "GPU computes it, fp32 elsewhere")
    flow = Flow.from_dir(model_dir, device)
    progress("auto: checking the flow candidates and timing them again (interleaved rounds)")
    c = auto.choose_fastest(flow, remeasure=True)
    m = c.measurement
    now = auto._clock()
    prev = None
    if c.previous is not None:
        name, pm = c.previous
        prev = {"verdict": name, "age_s": now - pm.measured_at, **pm.record(name)}
    return {"verdict": c.chosen.name, "trusted": c.source == "measured", "busy": c.busy,
            "replaced": c.source == "measured" and prev is not None,
            "written": c.source == "measured" and getattr(flow, "weights_file", None) is not None,
            "measurement": m.record(c.chosen.name) if m else None, "previous": prev,
            "checks": {r.candidate: {"mean_abs": r.mean_abs, "max_abs": r.max_abs, "passed": r.passed}
                       for r in c.checks + c.failed}}


def format_auto(a: dict) -> list[str]:
    """The lines of the ``auto`` part: the candidates' rounds and checks, the new verdict, the cached one."""
    from ..flow.auto import (
        CPU_SHARE_MIN,
        REAL_PROMPT_TOKENS,
        REAL_TOKENS,
        TIME_PROMPT_TOKENS,
        TIME_TOKENS,
        Measurement,
        format_age,
    )

    m = Measurement.from_record(a["measurement"])
    n = max(len(rs) for rs in m.rounds.values())
    order = " ".join(m.order[:len(m.rounds)])
    w = max([len("candidate")] + [len(x) for x in m.rounds] + [len(x) for x in a["checks"]]) + 2
    lines = ["", f"auto: the flow candidates timed again ({TIME_PROMPT_TOKENS}+{TIME_TOKENS} tokens, {n} interleaved "
             f"rounds: {order}, then back; {m.threads} threads)",
             f"{'candidate':<{w}}" + "".join(f"{f'round {i + 1} s':>11}" for i in range(n)) + f"{'best s':>9}"
             + (f"{f'at {REAL_PROMPT_TOKENS}+{REAL_TOKENS} s':>14}" if m.attention else "")
             + f"{'mel vs fp32 mean / max':>25}"]
    proj = m.projected
    for name, rs in sorted(m.rounds.items(), key=lambda kv: proj[kv[0]]):
        ck = a["checks"].get(name)
        fid = f"{ck['mean_abs']:.4f} / {ck['max_abs']:.4f}" if ck else "-"
        lines.append(f"{name:<{w}}" + "".join(f"{r:>11.3f}" for r in rs) + f"{min(rs):>9.3f}"
                     + (f"{proj[name]:>14.2f}" if m.attention else "") + f"{fid:>25}")
    for name, ck in a["checks"].items():
        if not ck["passed"]:
            fid = f"{ck['mean_abs']:.4f} / {ck['max_abs']:.4f}"
            lines.append(f"{name:<{w}}failed the fidelity check ({fid}): not timed")
    best = min(proj, key=proj.get)
    share = f"CPU {m.cpu_share:.0%} of {m.threads} threads (trusted from {CPU_SHARE_MIN:.0%})"
    load = f", load {m.load_before[0]:.1f} -> {m.load_after[0]:.1f}" if m.load_before and m.load_after else ""
    lines.append(f"now:    fastest {best}, {share}{load}")
    p = a["previous"]
    if p:
        pm = Measurement.from_record(p)
        lines.append(f"cached: {p['verdict']}, measured {format_age(p['age_s'])} ago at {pm.conditions()}")
    else:
        lines.append("cached: none for this model file, machine and thread count")
    if not a["trusted"]:
        lines.append(f"-> not cached: {a['busy']}; " + ("the cached verdict stays" if p else "nothing is written")
                     + f" (this run would use the rule of thumb, {a['verdict']})")
    elif not a["written"]:
        lines.append(f"-> {best} (not cached: the model was not loaded from a file)")
    elif p and p["verdict"] == best:
        lines.append(f"-> {best} again: the record is renewed")
    else:
        lines.append(f"-> {best} is cached" + (f", replacing {p['verdict']}" if p else ""))
    return lines


# ----------------------------------------------------------------------------------------------
# Whole pipeline (child processes)


def pipeline_worker(spec: dict) -> dict:
    """Run in a child process: load a TTS, synthesize non-streaming then streaming once; report."""
    from ..options import LoadOptions
    from ..tts import TTS, SynthesisOptions

    options = LoadOptions(**spec["load"])
    torch.set_num_threads(options.threads)
    tts = TTS(options)
    wav = spec["prompt_wav"]
    n = spec["decode_tokens"]
    opts = SynthesisOptions(greedy=True, ignore_stop=True, max_tokens=n)
    voice = tts.make_voice(wav)
    tts.cross_lingual("Warm up.", voice=voice, options=SynthesisOptions(greedy=True, max_tokens=5,
                                                                        ignore_stop=True)).audio()
    t0 = time.perf_counter()
    syn = tts.cross_lingual(BENCH_TEXT, wav, options=opts)
    audio = syn.audio()
    rtf = (time.perf_counter() - t0) / (audio.size / tts.sample_rate)
    llm_s, token2wav_s = syn.timings.llm, syn.timings.token2wav
    t0 = time.perf_counter()
    syn = tts.cross_lingual(BENCH_TEXT, wav, options=SynthesisOptions(greedy=True, ignore_stop=True,
                                                                     max_tokens=n, stream=True))
    first = None
    for chunk in syn:
        if first is None and chunk.samples.size:
            first = time.perf_counter() - t0
    from ..precision import precision_name

    flow = precision_name(tts.token2wav.flow.precision)
    why = tts.token2wav.flow.precision_choice.reason
    return {"flow": flow, "flow_why": why, "rtf": rtf, "first_chunk_s": first, "peak_rss_mb": peak_rss_mb(),
            "llm_s": llm_s, "token2wav_s": token2wav_s,  # of the non-streaming run (the RTF's)
            "stream_llm_s": syn.timings.llm, "stream_token2wav_s": syn.timings.token2wav}


def run_pipeline(model_dir: Path, threads: int, prompt_s: float, output_s: float, repeat: int,
                 progress: Progress, device: torch.device = torch.device("cpu")) -> list[dict]:
    """One child process per configuration and round (so each peak RSS is its own); with ``repeat``
    > 1 the configurations take turns (:func:`rounds`) and each row reports the medians."""
    wav = prompt_wav(prompt_s)
    gpu_layers = None
    configs = []
    for backend_name, layout, type_name, precision in PIPELINE_CONFIGS:
        load = {"model_dir": str(model_dir), "llm": backend_name, "threads": threads, "precision": precision,
                "device": str(device)}  # LoadOptions' fields, as JSON for the child
        label = "torch fp32" if backend_name == "torch" else f"llamacpp {layout} {type_name}"
        if layout:
            load["gguf"] = str(ensure_gguf(model_dir, layout, type_name, progress))
            if gpu_layers is None:
                gpu_layers = llamacpp_gpu_layers(device, progress)
            load["n_gpu_layers"] = gpu_layers
        spec = {"load": load, "prompt_wav": str(wav), "decode_tokens": round(output_s * TOKEN_RATE)}
        configs.append((len(configs), label, spec))
    runs: list[list[dict]] = [[] for _ in configs]
    for i, label, spec in rounds(configs, repeat):
        turn = f", round {len(runs[i]) + 1} of {repeat}" if repeat > 1 else ""
        progress(f"pipeline: {label}, flow {spec['load']['precision']} (child process{turn})")
        proc = subprocess.run([sys.executable, "-m", "cosyllama.tools.bench", "--pipeline-worker", json.dumps(spec)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pipeline worker for {label} failed:\n{proc.stderr[-4000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        runs[i].append(r)
        if r.get("flow_why"):
            progress(f"  flow {r['flow']} ({r['flow_why']})")  # auto: measured when, or why the rule of thumb
        fc = "-" if r["first_chunk_s"] is None else f"{r['first_chunk_s']:.2f} s"
        progress(f"  RTF {r['rtf']:.3f}, first chunk {fc}, peak RSS {r['peak_rss_mb']:.0f} MB")
    rows = []
    for (i, label, spec), rs in zip(configs, runs):
        med = {k: _median_or_none([r[k] for r in rs]) for k in ("rtf", "first_chunk_s", "llm_s", "token2wav_s",
                                                                "stream_llm_s", "stream_token2wav_s")}
        rows.append({"llm": label, "device": str(device), "flow": rs[-1]["flow"], "flow_why": rs[-1].get("flow_why"),
                     **med,
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "rounds": rs})
    return rows


# ----------------------------------------------------------------------------------------------


def format_table(res: dict) -> str:
    m = res["machine"]
    lines = [f"machine: {m['cpu']}, {m['threads']} threads"
             + (f"; torch stages on {m['device']} ({m['gpu']})" if m.get("device", "cpu") != "cpu" else "")]
    if "cpu_class" in m:
        lines.append(f"CPU class {m['cpu_class']} (ISA {' '.join(m['isa']) or '-'}; torch kernels {m['torch_kernels']})"
                     + (f"; llama.cpp build: {m['llama_cpp']}" if m.get("llama_cpp") else ""))
    if res["llm"]:
        lines += ["", "LLM stage (forced length)", f"{'backend':<10}{'layout':<8}{'type':<8}{'prefill':>8}"
                  f"{'decode':>8}{'tok/s':>9}{'LLM RTF':>9}{'vs torch':>9}"]
        base = next((r["tokens_per_s"] for r in res["llm"] if r["backend"] == "torch"), None)
        for r in res["llm"]:
            ratio = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
            lines.append(f"{r['backend']:<10}{r['layout'] or '-':<8}{r['type']:<8}{r['prefill_tokens']:>8}"
                         f"{r['decode_tokens']:>8}{r['tokens_per_s']:>9.1f}{r['rtf']:>9.3f}{ratio:>9}")
        by = {(r["layout"], r["type"]): r["tokens_per_s"] for r in res["llm"]}
        for t in LLM_TYPES:
            if ("speech", t) in by and ("merged", t) in by:
                lines.append(f"speech/merged at {t}: {by[('speech', t)] / by[('merged', t)]:.2f}x")
    lines += format_lines(res)
    if res.get("auto"):
        lines += format_auto(res["auto"])
    if res["pipeline"]:
        lines += ["", f"{'pipeline LLM':<24}{'flow':<6}{'RTF':>8}{'first chunk s':>15}{'peak RSS MB':>13}"]
        for r in res["pipeline"]:
            fc = f"{r['first_chunk_s']:.2f}" if r["first_chunk_s"] is not None else "-"
            lines.append(f"{r['llm']:<24}{r['flow']:<6}{r['rtf']:>8.3f}{fc:>15}{r['peak_rss_mb']:>13.0f}")
    return "\n".join(lines)


def llm_configs(types: str | None) -> list:
    """The LLM rows for ``--llm-types`` (comma list of GGUF types; None: all of LLM_TYPES)."""
    if types is None:
        return LLM_CONFIGS
    chosen = [t.strip() for t in types.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in LLM_TYPES]
    if unknown:
        raise InputError(f"unknown --llm-types {', '.join(unknown)}; choose from {', '.join(LLM_TYPES)}")
    return [c for c in LLM_CONFIGS if c[0] == "torch" or c[2] in chosen]


@dataclass(frozen=True)
class BenchOptions:
    """What ``cosyllama bench`` measures (its flags), checked on construction."""

    # comma list of the parts to run, from PARTS
    parts: str = "llm,flow,vocoder,pipeline"
    # the model directory; None: a cached full-size random model
    model_dir: str | None = None
    # a file the results are also written to as JSON; None: none
    json: str | None = None
    # runs per configuration (the median is reported)
    repeat: int = 1
    # comma list of the GGUF types of the llama.cpp LLM rows; None: LLM_TYPES
    llm_types: str | None = None
    # CPU threads; None (or 0): all cores this process may use
    threads: int | None = None
    # seconds of the synthetic prompt, in (0, 30]
    prompt_seconds: float = 3.0
    # seconds of audio each run makes, > 0
    output_seconds: float = 10.0
    # where the torch LLM, the flow and the vocoder run: cpu, cuda or cuda:N
    device: str = "cpu"
    # comma list of flow precisions (and research variants) to time; None: this device's default
    flow_precisions: str | None = None
    # comma list of vocoder variants; None: fp32,bf16
    vocoder_precisions: str | None = None
    # also split one flow and one vocoder call per variant by op kind (torch.profiler)
    profile: bool = False
    # also time one streaming synthesis per flow variant
    stream: bool = False
    # comma list of the request counts of the flow-batch part; None: its default
    batch_sizes: str | None = None

    def __post_init__(self):
        unknown = self.part_set - set(PARTS)
        if unknown:
            raise InputError(f"unknown --parts {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
        if self.repeat < 1:
            raise InputError(f"--repeat must be >= 1, got {self.repeat}")
        if self.output_seconds <= 0 or self.prompt_seconds <= 0 or self.prompt_seconds > 30:
            raise InputError("--output-seconds must be > 0 and --prompt-seconds in (0, 30]")

    @property
    def part_set(self) -> set[str]:
        return {p.strip() for p in self.parts.split(",") if p.strip()}


def run_bench(options: BenchOptions, progress: Progress = print) -> int:
    o = options
    parts = o.part_set
    threads = o.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    from ..device import resolve_device

    device = resolve_device(o.device)
    variants = flow_variants(o.flow_precisions, device)
    batch_variants = flow_variants(o.flow_precisions, device, reference=False)
    vocoder_names = vocoder_variants(o.vocoder_precisions)
    sizes = batch_sizes(o.batch_sizes)
    model_dir = Path(o.model_dir) if o.model_dir else ensure_full_model(progress)
    from ..config import load_config

    load_config(model_dir)
    machine = machine_info(threads, device, llm=bool(parts & {"llm", "pipeline"}))
    res = {"machine": machine, "model_dir": str(model_dir), "prompt_seconds": o.prompt_seconds,
           "output_seconds": o.output_seconds, "llm": [], "flow": [], "vocoder": [], "pipeline": [],
           "flow_batch": [], "auto": None}
    if "llm" in parts:
        res["llm"] = run_llm(model_dir, threads, o.prompt_seconds, o.output_seconds, o.repeat, progress,
                             configs=llm_configs(o.llm_types), device=device)
    if parts & {"flow", "vocoder"}:
        res["flow"], res["vocoder"] = run_flow_vocoder(
            model_dir, o.prompt_seconds, o.output_seconds, o.repeat, parts, progress, device,
            variants, vocoder_names, profile=o.profile, stream=o.stream)
    if "flow-batch" in parts:
        res["flow_batch"] = run_flow_batch(model_dir, o.prompt_seconds, o.output_seconds, o.repeat,
                                           progress, device, batch_variants, sizes)
    if "auto" in parts:
        res["auto"] = run_auto(model_dir, progress, device)
    if "pipeline" in parts:
        res["pipeline"] = run_pipeline(model_dir, threads, o.prompt_seconds, o.output_seconds, o.repeat,
                                       progress, device)
    print(format_table(res))
    if o.json:
        Path(o.json).write_text(json.dumps(res, indent=2), encoding="utf-8")
        print(f"wrote {o.json}")
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--pipeline-worker":
    print(json.dumps(pipeline_worker(json.loads(sys.argv[2]))))
