"""Does ``auto``'s timed solve predict the real work? Times fp32 and int8 flow solves at auto's timing shape
(``auto.TIME_PROMPT_TOKENS`` + ``auto.TIME_TOKENS``) and at larger ones, in turns (A B, B A after one untimed
solve each), on the full-size random model; prints each candidate's rounds and fp32's best over int8's.

    python scripts/auto_shape.py --shapes 25+50,75+150 --threads 2 --engine fbgemm
"""

from __future__ import annotations

import argparse
import json

import torch

from cosyllama.flow import Flow, auto, check
from cosyllama.precision import INT8
from cosyllama.progress import to_stderr
from cosyllama.tools.bench_setup import ensure_full_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=f"{auto.TIME_PROMPT_TOKENS}+{auto.TIME_TOKENS},75+150",
                   help="prompt+new tokens, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", default="fbgemm", help="the int8 engine to time against fp32")
    p.add_argument("--json", help="write the rounds here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flow = Flow.from_dir(ensure_full_model(to_stderr), precision="fp32")
    cands = [check.Candidate(torch.float32), check.Candidate(INT8, a.engine)]
    out = []
    for shape in a.shapes.split(","):
        prompt, tokens = (int(x) for x in shape.split("+"))
        inp = check.random_input(flow, check.CHECK_SEED + 1, prompt, tokens)
        for c in cands:
            auto._solve(flow, c, inp)  # untimed: kernels chosen, buffers sized
        rounds: dict[str, list[float]] = {c.name: [] for c in cands}
        for c in cands + cands[::-1]:
            rounds[c.name].append(round(auto._solve(flow, c, inp)[0], 3))
        best = {k: min(v) for k, v in rounds.items()}
        ratio = best[cands[0].name] / best[cands[1].name]
        out.append({"prompt": prompt, "tokens": tokens, "rounds": rounds, "fp32_over_int8": round(ratio, 3)})
        print(f"{prompt}+{tokens} tokens: {rounds}; fp32 / {cands[1].name} = {ratio:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
