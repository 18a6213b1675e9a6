"""llama.cpp decode speed, variants side by side: OpenMP settings, torch in the process, threads, KV type.

Each variant runs in its own child process (environment variables such as ``OMP_WAIT_POLICY``
only act before the OpenMP runtime loads), and the rounds interleave the variants, so load on a
shared machine hits all of them alike. A child prefills ``--prompt`` random tokens, then decodes
``--tokens`` tokens one ``llama_decode`` each with logits (the speech LLM's decode loop without
sampling), ``--repeat`` times, and reports its best tokens/s. Each round begins and ends measuring the memory
read bound (torch sum over 1 GiB) in a child of its own; tokens/s x bytes read per token gives the
share of that bound a variant reaches.

A variant is ``name:key=value,...`` (keys below) or a preset name from ``--list``:

    python scripts/bench_llm_decode.py                              # the default preset set
    python scripts/bench_llm_decode.py --variants no-torch,torch-matmul,q4_0 --rounds 3
    python scripts/bench_llm_decode.py --variants 'mine:type=Q4_0,threads=1,env.OMP_WAIT_POLICY=PASSIVE'

keys: type (F16/Q8_0/Q4_0: a GGUF of `cosyllama bench`'s cache, or gguf=PATH), torch
(none | import | matmul | thread: not loaded / imported first / imported and ran a 2-thread matmul
/ plus a thread that keeps running matmuls), threads, threads_batch, kv (f16/f32/q8_0), fa (on/off/
auto), repack (1/0: llama.cpp's CPU_REPACK buffers), load (mmap/none/mlock/mmap_mlock), batch
(sequences per step), hog (N busy processes beside the decode: a loaded machine), caller (main / worker:
llama_decode from a second Python thread, as the
scheduler does), adapt (1: threads lowered while other processes hold the cores, as the backend does
(cosyllama.llm.load_threads); 0: always ``threads``), env.NAME=VALUE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cosyllama.tools.bench_setup import full_model_dir
from cosyllama.tools.bench_setup import gguf_path as bench_gguf_path

BASE = {"type": "Q8_0", "torch": "matmul", "threads": "2", "kv": "f16", "fa": "auto", "repack": "1",
        "load": "mmap", "batch": "1", "caller": "main", "hog": "0", "adapt": "1"}
PRESETS = {
    "default": "",  # what `cosyllama bench` does: torch loaded and used first, Q8_0, F16 KV, 2 threads
    "no-torch": "torch=none",
    "torch-import": "torch=import",
    "torch-thread": "torch=thread",
    "worker": "caller=worker",
    "passive": "env.OMP_WAIT_POLICY=PASSIVE",
    "active": "env.OMP_WAIT_POLICY=ACTIVE",
    "spin0": "env.GOMP_SPINCOUNT=0",
    "spin1k": "env.GOMP_SPINCOUNT=1000",
    "spin10k": "env.GOMP_SPINCOUNT=10000",
    "spin30k": "env.GOMP_SPINCOUNT=30000",
    "spin100k": "env.GOMP_SPINCOUNT=100000",
    "spin-inf": "env.GOMP_SPINCOUNT=infinite",
    "hog": "hog=1",
    "hog-passive": "hog=1,env.OMP_WAIT_POLICY=PASSIVE",
    "hog-spin10k": "hog=1,env.GOMP_SPINCOUNT=10000",
    "hog-threads1": "hog=1,threads=1",
    "fixed": "adapt=0",
    "hog-fixed": "hog=1,adapt=0",
    "bind": "env.OMP_PROC_BIND=true,env.OMP_PLACES=cores",
    "threads1": "threads=1",
    "kv-f32": "kv=f32",
    "fa-on": "fa=on",
    "fa-off": "fa=off",
    "no-mmap": "load=none",
    "mlock": "load=mmap_mlock",
    "f16": "type=F16",
    "q4_0": "type=Q4_0",
    "q4_0-norepack": "type=Q4_0,repack=0",
    "batch4": "batch=4",
}
DEFAULT_SET = "default,no-torch,passive,active,threads1,kv-f32,fa-off,no-mmap,f16,q4_0,q4_0-norepack"


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, body = spec.partition(":")
    if not body and name in PRESETS:
        body = PRESETS[name]
    elif not body and "=" in name:
        name, body = spec, spec
    elif not body:
        raise SystemExit(f"unknown preset {name!r}; --list shows them")
    v = dict(BASE)
    for kv in filter(None, body.split(",")):
        k, sep, val = kv.partition("=")
        if not sep or not (k in BASE or k == "gguf" or k.startswith("env.")):
            raise SystemExit(f"bad key in variant {spec!r}: {kv!r}")
        v[k] = val
    return name, v


def gguf_path(v: dict) -> Path:
    if v.get("gguf"):
        return Path(v["gguf"])
    path = bench_gguf_path(full_model_dir(), "speech", v["type"])
    if not path.exists():
        raise SystemExit(f"no {path} (run `cosyllama bench` once, or pass gguf=PATH)")
    return path


def bytes_per_token(path: Path) -> int:
    """Weight bytes one decode step reads: every tensor but the token table, plus one row of it."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            n //= int(t.shape[-1])
        total += n
    return total


# ----------------------------------------------------------------------------------------------
# children


def child_bandwidth(threads: int) -> dict:
    import torch

    out = {}
    a = torch.ones(1 << 28, dtype=torch.float32)
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        a.sum()
        best = min(_timed(a.sum) for _ in range(5))
        out[str(t)] = a.numel() * 4 / best / 1e9
    return out


def _timed(fn) -> float:  # not cosyllama.timing: a child of a torch=none variant must not import torch
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def omp_libs() -> list[str]:
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if "omp" in os.path.basename(p):
                libs.add(p)
    return sorted(libs)


def child_decode(v: dict, tokens: int, prompt: int, repeat: int) -> dict:
    import ctypes
    import threading

    import numpy as np

    n_threads = int(v["threads"])
    stop = threading.Event()
    if v["torch"] != "none":
        import torch

        if v["torch"] in ("matmul", "thread"):
            torch.set_num_threads(n_threads)
            x = torch.randn(512, 512)
            for _ in range(5):
                x @ x
        if v["torch"] == "thread":
            def spin():  # a PyTorch thread team of its own that stays busy, like a server's flow thread
                torch.set_num_threads(n_threads)
                y = torch.randn(256, 256)
                while not stop.is_set():
                    y @ y
                    time.sleep(0.002)
            threading.Thread(target=spin, daemon=True).start()
    import llama_cpp as lc

    log: list[str] = []

    @lc.llama_log_callback
    def on_log(level, text, user):
        log.append(text.decode("utf-8", "replace") if text else "")

    lc.llama_log_set(on_log, ctypes.c_void_p(0))
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mode = getattr(lc, f"LLAMA_LOAD_MODE_{v['load'].upper()}")
    from cosyllama.cpu import llama_extra_buffer_types

    # repack=1 asks for extra buffer types, except the AMX one where its kernels crash (cosyllama.cpu)
    mp.use_extra_bufts = v["repack"] == "1" and llama_extra_buffer_types()[0]
    path = gguf_path(v)
    t0 = time.perf_counter()
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    load_s = time.perf_counter() - t0
    assert model, "".join(log[-20:])
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    nb = int(v["batch"])
    cp = lc.llama_context_default_params()
    cp.n_ctx = nb * 1024
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = nb
    cp.kv_unified = True
    cp.n_threads = n_threads
    cp.n_threads_batch = int(v.get("threads_batch") or n_threads)
    cp.type_k = cp.type_v = getattr(lc, f"GGML_TYPE_{v['kv'].upper()}")
    cp.flash_attn_type = {"on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                          "auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO}[v["fa"]]
    cp.no_perf = True
    ctx = lc.llama_init_from_model(model, cp)
    assert ctx, "".join(log[-20:])
    mem = lc.llama_get_memory(ctx)
    rng = np.random.default_rng(0)
    speech_vocab = min(n_vocab, 6761)

    batch = lc.llama_batch_init(max(prompt, nb), 0, 1)
    from cosyllama.llm.load_threads import LoadThreads

    governor = LoadThreads(n_threads, enabled=v["adapt"] == "1")
    used = [n_threads]

    def decode(tok, pos, seq, logits):
        n = len(tok)
        b = batch
        b.n_tokens = n
        for i in range(n):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tok[i]), int(pos[i]), 1, int(logits[i])
            b.seq_id[i][0] = int(seq[i])
        used[0] = governor.apply(lc, ctx, used[0])
        rc = lc.llama_decode(ctx, b)
        assert rc == 0, rc

    def run() -> tuple[float, float]:
        lc.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        for s in range(nb):
            toks = rng.integers(0, speech_vocab, prompt)
            decode(toks, np.arange(prompt), np.full(prompt, s), np.eye(1, prompt, prompt - 1, dtype=int)[0])
        t1 = time.perf_counter()
        for k in range(tokens):
            decode(rng.integers(0, speech_vocab, nb), np.full(nb, prompt + k), np.arange(nb), np.ones(nb, int))
            for i in range(nb):  # read the speech logits as the backend does
                np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))[:speech_vocab].copy()
        return t1 - t0, time.perf_counter() - t1

    result: dict = {}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(v["hog"]))]

    def body():
        for _ in range(repeat):
            result.setdefault("runs", []).append(run())

    if v["caller"] == "worker":
        th = threading.Thread(target=body)
        th.start()
        th.join()
    else:
        body()
    stop.set()
    for h in hogs:
        h.kill()
        h.wait()
    best = min(d for _, d in result["runs"])
    info = lc.llama_print_system_info()
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    keep = [ln.strip() for ln in log if "REPACK" in ln or "buffer size" in ln or "repack" in ln]
    return {"tok_s": nb * tokens / best, "prefill_s": min(p for p, _ in result["runs"]), "load_s": load_s,
            "omp_libs": omp_libs(), "system_info": info.decode() if isinstance(info, bytes) else str(info),
            "log": keep[:12], "gguf": str(path), "threads_at_end": used[0], "thread_changes": governor.changes}


def run_child(kind: str, payload: dict, env_extra: dict) -> dict:
    env = dict(os.environ)
    env.update(env_extra)
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps({"kind": kind, **payload})],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"child {kind} {payload} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--variants", default=DEFAULT_SET, help="comma list of presets or name:key=val,... "
                    "(';' separates variants when they contain commas)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200, help="decode steps per run")
    ap.add_argument("--prompt", type=int, default=118, help="prefill tokens (the bench's 3 s prompt: 118)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per child (its best counts)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--list", action="store_true", help="show the presets")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child)
        out = (child_bandwidth(job["threads"]) if job["kind"] == "bandwidth"
               else child_decode(job["variant"], job["tokens"], job["prompt"], job["repeat"]))
        print(json.dumps(out))
        return 0
    if args.list:
        for k, s in PRESETS.items():
            print(f"{k:16s} {s or '(the base: ' + ','.join(f'{a}={b}' for a, b in BASE.items()) + ')'}")
        return 0
    sep = ";" if ";" in args.variants else ","
    if sep == "," and ":" in args.variants:
        sep = ";"
    variants = [parse_variant(s.strip()) for s in args.variants.split(sep) if s.strip()]
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs", flush=True)
    res: dict = {"variants": {n: v for n, v in variants}, "rounds": [], "load_start": load}
    for r in range(args.rounds):
        rnd: dict = {"bandwidth": run_child("bandwidth", {"threads": 2}, {}), "decode": {}}
        print(f"round {r + 1}: read GB/s {', '.join(f'{k} thr {g:.1f}' for k, g in rnd['bandwidth'].items())}",
              flush=True)
        for name, v in variants:
            env = {k[4:]: val for k, val in v.items() if k.startswith("env.")}
            out = run_child("decode", {"variant": v, "tokens": args.tokens, "prompt": args.prompt,
                                       "repeat": args.repeat}, env)
            rnd["decode"][name] = out
            libs = " ".join(os.path.basename(p) + "@" + p.split("/")[-3] for p in out["omp_libs"])
            print(f"  {name:16s} {out['tok_s']:6.1f} tok/s  (prefill {out['prefill_s'] * 1e3:.0f} ms, "
                  f"load {out['load_s']:.2f} s, omp: {libs or '-'})",
                  flush=True)
        rnd["bandwidth_end"] = run_child("bandwidth", {"threads": 2}, {})
        print(f"  read GB/s after the round: {max(rnd['bandwidth_end'].values()):.1f}", flush=True)
        rnd["load"] = os.getloadavg()
        res["rounds"].append(rnd)
    bw = max(max(r[k].values()) for r in res["rounds"] for k in ("bandwidth", "bandwidth_end"))
    base = max(r["decode"][variants[0][0]]["tok_s"] for r in res["rounds"])
    print(f"\nbound: best read bandwidth {bw:.1f} GB/s; load average at end: {os.getloadavg()[0]:.2f}")
    print(f"| variant | tok/s per round | best | vs {variants[0][0]} | MB/token | GB/s | % of bound |")
    print("|---|---|---:|---:|---:|---:|---:|")
    res["table"] = []
    for name, v in variants:
        toks = [r["decode"][name]["tok_s"] for r in res["rounds"]]
        mb = bytes_per_token(gguf_path(v)) / 1e6
        best = max(toks) / int(v["batch"])  # per decode step: the weights are read once per step
        gbs = best * mb / 1e3
        row = {"variant": name, "tok_s": toks, "best": max(toks), "mb_per_token": mb, "gb_s": gbs,
               "pct_bound": 100 * gbs / bw}
        res["table"].append(row)
        print(f"| {name} | {' / '.join(f'{t:.1f}' for t in toks)} | {max(toks):.1f} | {max(toks) / base:.2f}x | "
              f"{mb:.0f} | {gbs:.1f} | {row['pct_bound']:.0f} % |")
    first = res["rounds"][0]["decode"][variants[0][0]]
    print(f"\n{first['system_info'].strip()}")
    for name, _ in variants:
        lines = res["rounds"][0]["decode"][name]["log"]
        if any("REPACK" in ln for ln in lines):
            print(f"{name}: " + "; ".join(ln for ln in lines if "REPACK" in ln))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
