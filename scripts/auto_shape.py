"""Does ``auto``'s timed solve predict the real work? Times flow candidates at auto's timing shape
(``auto.TIME_PROMPT_TOKENS`` + ``auto.TIME_TOKENS``) and at larger ones, in turns (A B C, C B A after one untimed
solve each), on the full-size random model; prints each candidate's rounds and fp32's best over each other's.

    python scripts/auto_shape.py --shapes 25+50,75+150 --threads 2 --engine fbgemm
    python scripts/auto_shape.py --shapes 25+50,75+139,75+250 --candidates fp32,bf16,int8/onednn+bf16+static
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
    p.add_argument("--candidates", default=None,
                   help="comma list of auto's candidate names to time (fp32 first), e.g. "
                        "fp32,bf16,int8/onednn+bf16+static; default fp32 and int8/ENGINE")
    p.add_argument("--json", help="write the rounds here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flow = Flow.from_dir(ensure_full_model(to_stderr), precision="fp32")
    if a.candidates:
        by_name = {c.name: c for c in auto.candidates(flow)}
        unknown = [n for n in a.candidates.split(",") if n not in by_name]
        if unknown:
            raise SystemExit(f"not a candidate on this machine: {', '.join(unknown)} (there are: {', '.join(by_name)})")
        cands = [by_name[n] for n in a.candidates.split(",")]
    else:
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
        ratios = {c.name: round(best[cands[0].name] / best[c.name], 3) for c in cands[1:]}
        out.append({"prompt": prompt, "tokens": tokens, "rounds": rounds, "first_over": ratios})
        shown = ", ".join(f"{cands[0].name} / {k} = {v:.2f}x" for k, v in ratios.items())
        print(f"{prompt}+{tokens} tokens: {rounds}; {shown}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
