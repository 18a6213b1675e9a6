"""Time a warmed voice's first streaming chunk with the fast flow solver's switches turned off, in one process:
``before`` (without the ``--switch`` ones: the position convs in float32, the modulations computed in every call,
the keys unpadded, PyTorch's attention, cached K/V joined to the new by a copy) and ``now`` (the defaults: bf16
position convs on the bf16 paths, modulations kept per schedule, the attention keys padded to 16 or the bf16
attention kernel where it runs, reading the cached K/V in place), alternating (A B, B A, ...), each request
after an untimed one on the rebuilt solver. Prints each setting's flow call and first audio per round and their
medians (default: the full-size random model, llama.cpp Q8_0, ``auto``'s flow path; ``--first-chunk-tokens N``:
the low-latency first chunk, its voice warmed for it).

    python scripts/ab_first_chunk.py --threads 2 --rounds 6 [--switch pad_keys] [--json FILE]
    python scripts/ab_first_chunk.py --threads 2 --rounds 6 --engines onednn+bf16,onednn+bf16+static
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import cosyllama  # noqa: E402
from bench_first_audio import Marks, first_audio_s  # noqa: E402
from cosyllama.flow.check import Candidate  # noqa: E402
from cosyllama.flow.fast_dit import FastDiT  # noqa: E402
from cosyllama.precision import INT8, precision_name  # noqa: E402
from cosyllama.tools.bench_setup import ensure_full_model, ensure_gguf, prompt_wav  # noqa: E402
from cosyllama.tts import SynthesisOptions  # noqa: E402

# the solver's switches (FastDiT class attributes, all on by default); "before" turns off those --switch names
SWITCHES = ("lowp_conv_pos", "keep_modulations", "pad_keys", "attention_kernel_on", "kv_in_place")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="model directory (default: the cached full-size random model)")
    p.add_argument("--llm", choices=["llamacpp", "torch"], default="llamacpp")
    p.add_argument("--precision", default="auto", help="flow precision (bf16 or int8 to force a fast path)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--switch", action="append", choices=SWITCHES,
                   help="time only this switch against its absence (repeatable; default: all of them)")
    p.add_argument("--engines", help="instead of switches: time these int8 engines against each other, comma-"
                                     "separated (e.g. onednn+bf16,onednn+bf16+static), every switch on")
    p.add_argument("--first-chunk-tokens", type=int, default=None,
                   help="the low-latency first chunk's speech tokens (default: the reference's schedule)")
    p.add_argument("--json", help="write the rounds here")
    a = p.parse_args(argv)
    off = [] if a.engines else a.switch or list(SWITCHES)
    if a.engines:  # every setting has the defaults; the engine is switched per setting below
        settings = {e: dict.fromkeys(SWITCHES, True) for e in a.engines.split(",")}
    else:
        settings = {"before": {k: k not in off for k in SWITCHES}, "now": dict.fromkeys(SWITCHES, True)}
    model = a.model_dir or ensure_full_model(print)
    gguf = ensure_gguf(model, "speech", "Q8_0", print) if a.llm == "llamacpp" else None
    tts = cosyllama.load(model, llm=a.llm, gguf=gguf, threads=a.threads, prompt_cache_mb=512, precision=a.precision)
    flow = tts.token2wav.flow
    if flow.precision == torch.float32:
        print("note: the flow runs fp32, the reference solver, which has no such switch: both rows time the same")
    voice = tts.make_voice(prompt_wav(a.prompt_seconds))
    tts.cross_lingual("Warm up.", voice=voice,
                      options=SynthesisOptions(greedy=True, max_tokens=5, ignore_stop=True)).audio()
    tts.warm_voice(voice, low_latency=a.first_chunk_tokens is not None)
    marks = Marks(tts)
    flow_s: dict[str, list[float]] = {k: [] for k in settings}
    first_s: dict[str, list[float]] = {k: [] for k in settings}
    try:
        for r in range(a.rounds):
            for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
                for attr, value in settings[name].items():
                    setattr(FastDiT, attr, value)
                if a.engines:
                    Candidate(INT8, name).apply(flow)  # calibrates a static engine once (cached)
                flow.decoder._fast.drop()  # the solver is rebuilt with the setting
                first_audio_s(tts, voice, 0, marks, a.first_chunk_tokens)  # untimed
                t, parts = first_audio_s(tts, voice, r, marks, a.first_chunk_tokens)
                flow_s[name].append(round(parts["flow_s"], 3))
                first_s[name].append(round(t, 3))
    finally:
        for attr in SWITCHES:  # the defaults back
            setattr(FastDiT, attr, True)
    for name in settings:
        print(f"{name}: first chunk's flow call {' '.join(f'{x:.3f}' for x in flow_s[name])} s "
              f"(median {statistics.median(flow_s[name]):.3f}); first audio median "
              f"{statistics.median(first_s[name]):.3f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"flow": precision_name(flow.precision), "switched": off,
                                            "first_chunk_tokens": a.first_chunk_tokens,
                                            "engine": a.engines or flow.decoder.int8_engine, "threads": a.threads,
                                            "flow_s": flow_s, "first_audio_s": first_s}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
