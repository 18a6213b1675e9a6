"""Concurrent non-streaming flow solves: one after another vs one batch, side by side (issue #17).

N requests that reach the flow together are solved two ways in one process, interleaved round by
round: (a) serialized — N ``Flow.inference`` calls in turn, what concurrent requests get today;
(b) batched — one ``Flow.inference_batch`` of the same N inputs (each row still carries its own
CFG pair, so the DiT sees 2N rows). Equal lengths only: every request has the same prompt (one
voice, ``--prompt-s``) and the same output length (``--out-s``) with its own random tokens. Per N:
seconds per request both ways (best of ``--rounds``, CUDA synchronized), the speed-up, and the max
abs difference of the batched mels from the serialized ones (float rounding only: the rows share no
arithmetic). The answer decides whether the server should batch concurrent flows on that device.

    python scripts/bench_flow_batch.py --device cuda --precision bf16,fp32 --json flow-batch.json
    python scripts/bench_flow_batch.py --model-dir tests/fixtures/cosyvoice3-tiny/model --n 1,2,4

Without ``--model-dir`` it uses the full-size random model (``cosyllama bench``'s; made once, ~4 GB):
real shapes, noise audio. Don't run that on a shared CPU: a 16-request round is minutes there.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cosyllama.timing import timed

TOKEN_RATE = 25  # speech tokens per second; the flow makes 2 mel frames per token


def _requests(n: int, prompt_s: float, out_s: float, vocab: int, dev: torch.device) -> list[tuple]:
    """``n`` requests of one prompt (tokens, mel, speaker embedding) and their own output tokens."""
    p, t = round(prompt_s * TOKEN_RATE), round(out_s * TOKEN_RATE)
    g = torch.Generator().manual_seed(0)
    prompt = (torch.randint(0, vocab, (1, p), generator=g, dtype=torch.int32).to(dev),
              (torch.randn(1, 2 * p, 80, generator=g) - 5).to(dev), torch.randn(1, 192, generator=g).to(dev))
    return [(torch.randint(0, vocab, (1, t), generator=g, dtype=torch.int32).to(dev), *prompt) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--model-dir", type=Path, help="model directory (default: the full-size random model)")
    ap.add_argument("--precision", default="fp32", help="flow precisions, comma list (fp32,bf16,int8; default fp32)")
    ap.add_argument("--n", default="1,2,4,8,16", help="concurrent requests per row, comma list (default 1,2,4,8,16)")
    ap.add_argument("--prompt-s", type=float, default=3.0, help="prompt seconds (default 3)")
    ap.add_argument("--out-s", type=float, default=10.0, help="output seconds per request (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per row, best kept (default 3)")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="start no new row after this many seconds (0: no limit); rows done are kept")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for PyTorch (0: its default)")
    ap.add_argument("--json", type=Path, help="write the results here (rewritten after every row)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from cosyllama.device import resolve_device
    from cosyllama.flow import Flow
    from cosyllama.precision import precision_name
    from cosyllama.tools.kit import ensure_full_model

    t_start = time.perf_counter()
    dev = resolve_device(args.device)
    ns = [int(x) for x in args.n.split(",") if x.strip()]
    precisions = [x.strip() for x in args.precision.split(",") if x.strip()]
    if not ns or min(ns) < 1 or not precisions or args.rounds < 1:
        ap.error("--n needs integers >= 1, --precision at least one name, --rounds >= 1")
    model_dir = args.model_dir or ensure_full_model(print)
    flow = Flow.from_dir(model_dir, dev)
    reqs = _requests(max(ns), args.prompt_s, args.out_s, flow.cfg.vocab_size, dev)
    frames = 2 * (reqs[0][0].shape[1] + reqs[0][1].shape[1])
    res = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "model_dir": str(model_dir), "prompt_s": args.prompt_s,
           "out_s": args.out_s, "mel_frames_per_request": frames, "rounds": args.rounds,
           "inputs": "equal lengths: every request has the same prompt and output length, its own output tokens",
           "rows": [], "skipped": []}

    def write() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(".tmp")
            tmp.write_text(json.dumps(res, indent=1))
            tmp.replace(args.json)

    print(f"flow batch on {res['device_name']}: {args.prompt_s:g} s prompt + {args.out_s:g} s output "
          f"({frames} mel frames per request), best of {args.rounds}")
    for prec in precisions:
        flow.set_precision(prec)
        name = precision_name(flow.precision)
        flow.inference(*reqs[0])  # warm-up: weight packing, kernels
        for n in ns:
            if args.time_limit and time.perf_counter() - t_start > args.time_limit:
                res["skipped"].append({"precision": name, "n": n, "why": "time limit"})
                print(f"  {name} N={n}: skipped (time limit)")
                continue
            batch_in = reqs[:n]
            flow.inference_batch(batch_in)  # warm-up of this batch shape
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            serial, batched = [], []
            for _ in range(args.rounds):  # interleaved: a load change hits both ways alike
                s, _, mels = timed(lambda: [flow.inference(*r) for r in batch_in], dev)
                b, _, bmels = timed(lambda: flow.inference_batch(batch_in), dev)
                serial.append(s)
                batched.append(b)
            diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(bmels, mels))
            row = {"precision": name, "n": n, "serial_s_per_request": min(serial) / n,
                   "batched_s_per_request": min(batched) / n, "speedup": min(serial) / min(batched),
                   "max_abs_diff_batched_vs_serial": diff, "serial_s_rounds": serial, "batched_s_rounds": batched}
            if dev.type == "cuda":
                row["peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
            res["rows"].append(row)
            write()
            print(f"  {name} N={n:>2}: serialized {row['serial_s_per_request']:.4f} s/request, batched "
                  f"{row['batched_s_per_request']:.4f} s/request, {row['speedup']:.2f}x, max abs diff {diff:.2e}")
    res["seconds"] = time.perf_counter() - t_start
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
