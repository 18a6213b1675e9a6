"""How far a quantized GGUF's speech LLM is from float32: token agreement and KL, per type.

Two measurements against a float32 reference (the PyTorch LLM on the checkpoint, or ``--reference
F32`` for the float32 GGUF), for each GGUF type in ``--types``:

* **teacher-forced**: the reference decodes greedily (``--steps`` speech tokens, stop tokens never
  taken so every prompt gives the same number of steps); each type is fed the same tokens and at
  every position we compare its distribution with the reference's: top-1 agreement (same argmax),
  KL(reference || type) in nats, and the probability the type gives the reference's token.
* **free-running greedy**: each type decodes greedily on its own; the tokens it agrees with the
  reference before the first difference (the prefix), and the share of positions equal.

Greedy argmax is the harshest view: sampling (RAS, the default) draws from the top-k, so a change
of argmax between two near-equal tokens costs little audibly, while a KL that grows along the
sequence does. Random weights (the full-size random-weight model) give near-flat logits, where argmax flips
easily: their agreement is a lower bound, not the official model's figure. Run it on the official
model directory for that (``--model-dir``; its GGUFs are converted once into the cache).

    python scripts/llm_fidelity.py --tiny                        # the test fixture's tiny model
    python scripts/llm_fidelity.py --types Q8_0,Q4_0,Q4_K_M       # full-size random model (bench_setup)
    python scripts/llm_fidelity.py --model-dir Fun-CosyVoice3-0.5B --prompts 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "cosyvoice3-tiny"
TINY_MODEL = TINY / "model"


def prompts(config, n: int, text_len: int, speech_len: int, seed: int):
    """``n`` random prefills: text ids from the ordinary text vocabulary, prompt speech ids in [0, 6561)."""
    from cosyllama.llm.backend import Prefill

    rng = np.random.default_rng(seed)
    n_text = min(config.llm.qwen.vocab_size, 150000)
    n_speech = config.llm.speech_token_size
    out = []
    for _ in range(n):
        text = tuple(int(x) for x in rng.integers(0, n_text, text_len))
        speech = tuple(int(x) for x in rng.integers(0, n_speech, speech_len))
        out.append(Prefill(text, speech))
    return out


def speech_argmax(logp: torch.Tensor, n_speech: int) -> int:
    return int(torch.argmax(logp[:n_speech]))


def reference_run(ref, prefill, steps: int, n_speech: int):
    """The reference's greedy tokens and its log-prob rows at every position (steps + 1 rows)."""
    h, logp = ref.start(prefill, steps + 1)
    rows, toks = [logp], []
    try:
        for _ in range(steps):
            toks.append(speech_argmax(rows[-1], n_speech))
            rows.append(ref.step([(h, toks[-1])])[0])
    finally:
        ref.release(h)
    return toks, torch.stack(rows)


def forced_run(backend, prefill, toks):
    h, logp = backend.start(prefill, len(toks) + 1)
    rows = [logp]
    try:
        for t in toks:
            rows.append(backend.step([(h, t)])[0])
    finally:
        backend.release(h)
    return torch.stack(rows)


def free_run(backend, prefill, steps: int, n_speech: int):
    h, logp = backend.start(prefill, steps + 1)
    toks = []
    try:
        for _ in range(steps):
            toks.append(speech_argmax(logp, n_speech))
            logp = backend.step([(h, toks[-1])])[0]
    finally:
        backend.release(h)
    return toks


def compare(ref_rows: torch.Tensor, rows: torch.Tensor, ref_toks, n_speech: int) -> dict:
    p = ref_rows.exp()
    kl = (p * (ref_rows - rows)).sum(-1).clamp_min(0)  # per position, nats
    top1 = (ref_rows[:, :n_speech].argmax(-1) == rows[:, :n_speech].argmax(-1)).double()
    chosen = rows[:-1][torch.arange(len(ref_toks)), torch.tensor(ref_toks)].exp()  # the last row has no token
    return {"top1": float(top1.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "kl_last_quarter": float(kl[-max(1, len(kl) // 4):].mean()),
            "p_ref_token": float(chosen.mean())}


def prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", help="model directory (default: the full-size random-weight model)")
    ap.add_argument("--tiny", action="store_true", help="the test fixture's tiny model (seconds)")
    ap.add_argument("--types", default="Q8_0,Q4_0", help="GGUF types to compare (default Q8_0,Q4_0)")
    ap.add_argument("--reference", default="torch", help="torch (the checkpoint in float32) or F32 (its GGUF)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150, help="speech tokens per prompt (6 s of audio at 25 Hz)")
    ap.add_argument("--text-len", type=int, default=40)
    ap.add_argument("--speech-len", type=int, default=75, help="prompt speech tokens (3 s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from cosyllama.config import load_config
    from cosyllama.llm.factory import make_llm
    from cosyllama.llm.llamacpp_backend import LlamaCppLLM
    from cosyllama.tools.bench_setup import ensure_full_model, ensure_gguf

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    torch.set_num_threads(args.threads)
    if args.tiny:
        model_dir = TINY_MODEL
    else:
        model_dir = Path(args.model_dir).resolve() if args.model_dir else ensure_full_model(say)
    config = load_config(model_dir)
    n_speech = config.llm.speech_token_size
    if args.reference.lower() == "torch":
        ref = make_llm(config, "torch", threads=args.threads)
        ref_name = "torch float32"
    else:
        ref = LlamaCppLLM(ensure_gguf(model_dir, "speech", "F32", say), config, n_threads=args.threads)
        ref_name = "GGUF F32"
    pfs = prompts(config, args.prompts, args.text_len, args.speech_len, args.seed)
    if args.tiny:  # the recorded reference prompt first (tests/fixtures: llm_teacher_forced)
        from cosyllama.llm.backend import Prefill

        a = np.load(TINY / "llm_teacher_forced.npz")
        pfs[0] = Prefill(tuple(int(x) for x in np.concatenate([a["prompt_text"][0], a["text"][0]])),
                         tuple(int(x) for x in a["prompt_speech_token"][0]))
    say(f"reference ({ref_name}): {len(pfs)} prompts x {args.steps} tokens")
    refs = [reference_run(ref, pf, args.steps, n_speech) for pf in pfs]
    ref_free = [t for t, _ in refs]  # greedy on its own = the forced tokens for the reference itself

    results = {"model_dir": str(model_dir), "reference": ref_name, "prompts": len(pfs), "steps": args.steps,
               "types": {}}
    for type_name in [t.strip() for t in args.types.split(",") if t.strip()]:
        path = ensure_gguf(model_dir, "speech", type_name, say)
        b = LlamaCppLLM(path, config, n_threads=args.threads)
        try:
            per = [compare(rows, forced_run(b, pf, toks), toks, n_speech)
                   for pf, (toks, rows) in zip(pfs, refs)]
            free = [free_run(b, pf, args.steps, n_speech) for pf in pfs]
        finally:
            b.close()
        prefixes = [prefix_len(a, r) for a, r in zip(free, ref_free)]
        equal = [float(np.mean([x == y for x, y in zip(a, r)])) for a, r in zip(free, ref_free)]
        agg = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        agg["kl_max"] = max(p["kl_max"] for p in per)
        agg.update(free_prefix_mean=float(np.mean(prefixes)), free_prefix_min=int(min(prefixes)),
                   free_equal=float(np.mean(equal)))
        results["types"][type_name] = agg

    print(f"{'type':8s} {'top-1':>6s} {'KL mean':>9s} {'KL max':>8s} {'KL end':>8s} {'p(ref)':>7s} "
          f"{'prefix':>7s} {'min':>4s} {'equal':>6s}   vs {ref_name}, {len(pfs)} x {args.steps} tokens")
    for t, a in results["types"].items():
        print(f"{t:8s} {a['top1']:6.3f} {a['kl_mean']:9.5f} {a['kl_max']:8.4f} {a['kl_last_quarter']:8.5f} "
              f"{a['p_ref_token']:7.3f} {a['free_prefix_mean']:7.1f} {a['free_prefix_min']:4d} "
              f"{a['free_equal']:6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(math.isfinite(a["kl_mean"]) for a in results["types"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
