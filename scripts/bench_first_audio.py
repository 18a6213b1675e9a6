"""Time to first streamed audio for repeated requests with one voice, with and without the flow
blocks shared between requests of a voice (``prompt_cache_mb``).

Full-size random model from ``cosyllama bench``'s cache (made on first use), speech-layout GGUF,
one voice from the bench's prompt clip, ``--requests`` streamed cross-lingual calls with forced
length, each closed after its first non-empty chunk:

    python scripts/bench_first_audio.py --threads 2 --prompt-cache-mb 0,512
    python scripts/bench_first_audio.py --threads 2 --prompt-cache-mb 512 --warm --breakdown

``--breakdown`` splits each first audio into its serial parts: text front end and LLM prefill up to the first
speech token, the rest of the tokens the first chunk needs, the chunk's flow call and its vocoder call.
``--profile`` also splits the last request's first flow call by operator (``torch.profiler``, self CPU time).

``--paths`` compares how the request reaches the models, request by request in turns (A B, B A, ...):
``direct`` decodes on the request's own thread (``cosyllama synth``, the Python API), ``scheduler`` through
the servers' batch scheduler on its own thread, pausing decoding for the first chunk as ``serve`` does
on 2 cores; ``/main`` runs the request on the main thread, ``/thread`` on a fresh thread each time, as
the servers' executors do:

    python scripts/bench_first_audio.py --threads 2 --prompt-cache-mb 512 --warm --breakdown \
        --paths direct/main,scheduler/thread
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import cosyllama
from cosyllama.llm.factory import make_token_source
from cosyllama.precision import precision_name
from cosyllama.server.serving import choose_interleave
from cosyllama.timing import rounds
from cosyllama.tools.bench_setup import BENCH_TEXT, ensure_full_model, ensure_gguf, prompt_wav
from cosyllama.tts import TTS, SynthesisOptions


class Marks:
    """Instruments a loaded TTS: when its first speech token came, and the first flow and vocoder
    calls' start and end (a benchmark's wrapper; the engine is unchanged)."""

    def __init__(self, tts):
        self.t: dict[str, float] = {}
        t2w, source = tts.token2wav, tts.token_source
        mel, vocode, generate = t2w._mel, t2w._vocode_new, source.generate

        def timed(name, fn):
            def call(*a, **kw):
                self.t.setdefault(name + "_start", time.perf_counter())
                try:
                    return fn(*a, **kw)
                finally:
                    self.t.setdefault(name + "_end", time.perf_counter())
            return call

        def tokens(*a, **kw):
            for n, tok in enumerate(generate(*a, **kw)):
                if n == 0:
                    self.t.setdefault("first_token", time.perf_counter())
                yield tok

        t2w._mel, t2w._vocode_new, source.generate = timed("flow", mel), timed("vocoder", vocode), tokens

    def split(self, t0: float, end: float) -> dict:
        t = self.t
        return {"to_first_token_s": t["first_token"] - t0, "more_tokens_s": t["flow_start"] - t["first_token"],
                "flow_s": t["flow_end"] - t["flow_start"], "vocoder_s": t["vocoder_end"] - t["vocoder_start"],
                "rest_s": end - t["vocoder_end"]}


def first_audio_s(tts, voice, seed: int, marks: Marks | None = None,
                  first_chunk: int | None = None) -> tuple[float, dict | None]:
    opts = SynthesisOptions(seed=seed, stream=True, ignore_stop=True, max_tokens=250, first_chunk_tokens=first_chunk)
    if marks is not None:
        marks.t.clear()
    t0 = time.perf_counter()
    chunks = iter(tts.cross_lingual(BENCH_TEXT, voice=voice, options=opts))
    try:
        while next(chunks).samples.size == 0:
            pass
        end = time.perf_counter()
        return end - t0, (marks.split(t0, end) if marks is not None else None)
    finally:
        chunks.close()


PATHS = ("direct/main", "direct/thread", "scheduler/main", "scheduler/thread")


def on_thread(fn, fresh: bool):
    """``fn()`` on this thread, or on a fresh one (its result or exception either way)."""
    if not fresh:
        return fn()
    with ThreadPoolExecutor(1) as pool:  # a new executor: a thread that never ran torch before
        return pool.submit(fn).result()


def profiled_request(tts, voice, seed: int, marks: Marks | None, first_chunk: int | None = None):
    """One more request whose first flow call runs under ``torch.profiler``; prints its operator table."""
    from torch.profiler import ProfilerActivity, profile

    t2w = tts.token2wav
    inner, done = t2w._mel, []

    def mel(*a, **kw):
        if done:
            return inner(*a, **kw)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = inner(*a, **kw)
        done.append(prof)
        return out

    t2w._mel = mel
    try:
        run = first_audio_s(tts, voice, seed, marks, first_chunk)
    finally:
        t2w._mel = inner
    print(done[0].key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="model directory (default: the cached full-size random model)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--type", default="Q8_0", help="GGUF type of the speech-layout LLM (default Q8_0)")
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--prompt-cache-mb", default="0,512", help="comma list of bounds to compare")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="warm the voice (TTS.warm_voice) before the requests")
    p.add_argument("--llm", choices=["llamacpp", "torch"], default="llamacpp")
    p.add_argument("--device", default="cpu", help="cpu or cuda (flow, vocoder, torch LLM; llama.cpp layers if its "
                                                   "build has GPU support)")
    p.add_argument("--llm-precision", default="fp32", help="torch LLM precision (fp32|bf16|fp16)")
    p.add_argument("--precision", default="auto", help="flow precision")
    p.add_argument("--breakdown", action="store_true", help="split each first audio into its serial parts")
    p.add_argument("--profile", action="store_true", help="split the last request's first flow call by operator")
    p.add_argument("--paths", default="direct/main",
                   help=f"comma list of {', '.join(PATHS)}: how requests reach the models, in turns (see above)")
    p.add_argument("--first-chunk-tokens", type=int, default=None,
                   help="the low-latency first chunk's speech tokens (default: the reference's schedule)")
    p.add_argument("--json", help="append one JSON line per setting here")
    args = p.parse_args(argv)
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or any(x not in PATHS for x in paths) or len(set(paths)) < len(paths):
        p.error(f"--paths: a comma list of distinct {', '.join(PATHS)}")
    if args.profile and paths != ["direct/main"]:
        p.error("--profile profiles the direct path alone: leave --paths out")
    model = args.model_dir or ensure_full_model(print)
    gguf = ensure_gguf(model, "speech", args.type, print) if args.llm == "llamacpp" else None
    for mb in (float(x) for x in args.prompt_cache_mb.split(",")):
        tts = cosyllama.load(model, llm=args.llm, gguf=gguf, threads=args.threads, prompt_cache_mb=mb,
                             device=args.device, precision=args.precision,
                             **({"llm_precision": args.llm_precision} if args.llm == "torch" else {}))
        voice = tts.make_voice(prompt_wav(args.prompt_seconds))
        tts.cross_lingual("Warm up.", voice=voice,
                          options=SynthesisOptions(greedy=True, max_tokens=5, ignore_stop=True)).audio()
        tts.token2wav.clear_prompt_cache()
        warm = ""
        if args.warm:
            t0 = time.perf_counter()
            kept = tts.warm_voice(voice, low_latency=args.first_chunk_tokens is not None)
            warm = f" (warmed first: {time.perf_counter() - t0:.2f} s, {'kept' if kept else 'nothing kept'})"
        scheduler = None
        pipes = {}
        for path in paths:
            if path.startswith("scheduler") and scheduler is None:
                scheduler = make_token_source(tts.llm, batched=True, interleave=choose_interleave(tts)[0])
            pipe = tts if path.startswith("direct") else TTS.from_models(tts.models, token_source=scheduler,
                                                                          voices=tts.voices)
            pipes[path] = (pipe, Marks(pipe) if args.breakdown else None)
        runs: dict[str, list] = {path: [] for path in paths}
        for k, path in enumerate(rounds(paths, args.requests - args.profile)):
            pipe, marks = pipes[path]
            seed = k // len(paths)  # request i of every path has the seed i
            runs[path].append(on_thread(lambda: first_audio_s(pipe, voice, seed, marks, args.first_chunk_tokens),
                                        path.endswith("/thread")))
        if args.profile:
            runs[paths[0]].append(profiled_request(tts, voice, args.requests - 1, pipes[paths[0]][1],
                                                      args.first_chunk_tokens))
        if scheduler is not None:
            scheduler.close()
        for path in paths:
            times = [t for t, _ in runs[path]]
            via = "" if paths == ["direct/main"] else f" [{path}]"
            print(f"prompt_cache_mb={mb:g}{warm}{via}: first audio " + ", ".join(f"{t:.2f}" for t in times) + " s",
                  flush=True)
            for _, parts in runs[path]:
                if parts is not None:
                    print("  " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f}" for k, v in parts.items()) + " s")
            if args.json:
                row = {"llm": args.llm, "type": args.type if gguf else args.llm_precision, "device": args.device,
                       "flow": precision_name(tts.token2wav.flow.precision), "prompt_cache_mb": mb,
                       "warm": args.warm, "path": path, "first_chunk_tokens": args.first_chunk_tokens,
                       "first_audio_s": times,
                       "breakdown": [parts for _, parts in runs[path] if parts is not None]}
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del tts, pipes
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
