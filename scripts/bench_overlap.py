"""Streaming on two cores: should the LLM and the flow split the cores or share them?

In a streaming request served through the batching scheduler (as `cosyllama serve` does), the LLM decodes in
the scheduler's thread while the flow and vocoder work on the previous chunk in the request's thread, so the
two overlap in time. Each setting gives llama.cpp ``L`` threads and PyTorch ``F`` threads (``L:F``; 2:2 puts
four threads on two cores, 1:1 splits them); a trailing ``a`` (``2:2a``) makes the scheduler take no decode step
while any flow or vocoder call runs (``--interleave all``), a trailing ``f`` only while a stream's first chunk is
made (``--interleave first``), so the stages take turns on the cores instead of sharing them. Per setting, a warmed
voice and ``--requests`` streamed cross-lingual requests of ``--tokens`` forced tokens (the bench's 10 s)
report the time to the first audio and the whole request's real-time factor; the settings take turns request
by request (A B C, C B A), so a machine that slows down moves them alike.

    python scripts/bench_overlap.py --splits 2:2,2:2f,2:2a,1:1,1:2,2:1 --requests 2 --json overlap.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import cosyllama
from cosyllama.llm.factory import make_token_source
from cosyllama.timing import rounds
from cosyllama.tools.bench_setup import BENCH_TEXT, ensure_full_model, ensure_gguf, prompt_wav
from cosyllama.tts import TTS, SynthesisOptions


def one_request(tts, voice, seed: int, tokens: int) -> dict:
    opts = SynthesisOptions(seed=seed, stream=True, ignore_stop=True, max_tokens=tokens)
    t0 = time.perf_counter()
    first, samples = None, 0
    for chunk in tts.cross_lingual(BENCH_TEXT, voice=voice, options=opts):
        if first is None and chunk.samples.size:
            first = time.perf_counter() - t0
        samples += chunk.samples.size
    wall = time.perf_counter() - t0
    return {"first_audio_s": first, "wall_s": wall, "rtf": wall / (samples / tts.sample_rate)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--splits", default="2:2,2:2f,2:2a,1:1,1:2,2:1",
                   help="comma list of LLM:flow thread counts; 'f' or 'a' appended: interleaved, first chunk or all")
    p.add_argument("--requests", type=int, default=2, help="rounds (each setting serves one request per round)")
    p.add_argument("--tokens", type=int, default=250)
    p.add_argument("--type", default="Q8_0", help="GGUF type of the speech-layout LLM")
    p.add_argument("--json")
    args = p.parse_args(argv)
    modes = {"f": "first", "a": "all"}
    splits = [(*(int(x) for x in s.rstrip("fa").split(":")), modes.get(s[-1], "off"))
              for s in (x.strip() for x in args.splits.split(",")) if s]
    model = ensure_full_model(print)
    gguf = ensure_gguf(model, "speech", args.type, print)
    # One TTS per setting, loaded up front (llama.cpp's thread count is fixed when its context is made).
    loaded = {}
    for llm_threads, flow_threads, interleave in splits:
        tts = cosyllama.load(model, llm="llamacpp", gguf=gguf, threads=llm_threads, precision="auto")
        sched = make_token_source(tts.llm, batched=True, interleave=interleave)
        view = TTS.from_models(tts.models, token_source=sched)
        voice = view.make_voice(prompt_wav(3.0))
        loaded[(llm_threads, flow_threads, interleave)] = (view, voice, sched)
    rows: dict = {s: [] for s in splits}
    for k, split in enumerate(rounds(splits, args.requests)):
        view, voice, _ = loaded[split]
        torch.set_num_threads(split[1])  # process-wide: set before each request
        if not rows[split]:
            view.warm_voice(voice)
        r = one_request(view, voice, k, args.tokens)
        rows[split].append(r)
        print(f"LLM {split[0]} / flow {split[1]} threads, interleave {split[2]}: "
              f"first audio {r['first_audio_s']:.2f} s, "
              f"RTF {r['rtf']:.2f}", flush=True)
    out = []
    for split, rs in rows.items():
        med = sorted(x["rtf"] for x in rs)[len(rs) // 2]
        first = sorted(x["first_audio_s"] for x in rs)[len(rs) // 2]
        out.append({"llm_threads": split[0], "flow_threads": split[1], "interleave": split[2], "median_rtf": med,
                    "median_first_audio_s": first, "rounds": rs})
        print(f"{split[0]}:{split[1]} interleave {split[2]}  median first audio {first:.2f} s, median RTF {med:.2f}")
    for _, _, sched in loaded.values():
        sched.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"splits": out, "tokens": args.tokens, "type": args.type}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
