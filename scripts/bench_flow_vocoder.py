"""Time the flow (DiT CFM) and the HiFT vocoder at the real Fun-CosyVoice3-0.5B sizes, per precision.

Builds both modules with random weights straight from configs (no model files), then times one
non-streaming synthesis of ``--out-s`` seconds after a ``--prompt-s`` seconds prompt, for every
variant in the same process, interleaved round by round (so a load change on a shared machine hits
all variants alike); the median and best of ``--repeats`` rounds are kept. Random weights give noise
audio but the real amount of work. Also reports each fast variant's fidelity against float32 on the
same inputs (mel mean/max abs difference, natural-log mel units; for the vocoder the log-mel of its
waveform), and the time to the first streaming chunk through the engine's :class:`Token2Wav`.

Flow variants: ``fp32`` (reference eager), ``bf16`` (``Flow.set_precision("bf16")``, what ``auto``
picks on CPUs with AVX512-BF16/AMX), ``int8`` (what ``auto`` picks on other x86 CPUs when it passes
its fidelity check), ``fp32-autocast`` (the reference path under a plain
``torch.autocast("cpu", dtype=torch.bfloat16)``: the baseline issue 19 asks the bf16 path to beat), ``fp32-fast``
(the bf16 solver's re-arranged float32 twin:
shows what restructuring alone gives), ``bf16-res16`` (bf16 residual stream too — measured, not
offered), and ``bf16-steps<N>`` (fewer Euler steps: an explicit quality trade).
Vocoder variants: ``fp32`` and the opt-in ``bf16`` (the default channels-last conv stack), and
``fp32-ref`` / ``bf16-ref`` (the module-by-module reference path, ``HiFT.fast = False``).

    python scripts/bench_flow_vocoder.py                          # 2 threads, CPU
    python scripts/bench_flow_vocoder.py --repeats 3 --profile    # + where the flow time goes
    python scripts/bench_flow_vocoder.py --flow-variants fp32,bf16,bf16-steps5 --stream
    python scripts/bench_flow_vocoder.py --device cuda
    python scripts/bench_flow_vocoder.py --flow-variants fp32 --repeats 1 --vocoder-repeats 5 \
        --vocoder-variants fp32,fp32-ref,bf16,bf16-ref --vocoder-stream      # the vocoder's numbers
    python scripts/bench_flow_vocoder.py --only-stream-cache --repeats 2   # streaming flow, K/V cache on/off

``--stream-cache`` / ``--only-stream-cache``: the flow calls of one whole streaming synthesis
through the engine (25 -> 50 -> 100 token hops, block-causal calls, then the final full-attention
call; a stand-in vocoder), with the per-request flow cache (``FlowStreamCache``) and without,
interleaved per round, for the plain fp32 and bf16 variants: total flow time, first chunk, final
call, the cache's peak size and the mel difference between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from cosyllama.device import resolve_device
from cosyllama.flow import FastDiT, Flow
from cosyllama.precision import resolve_precision
from cosyllama.timing import sync, timed
from cosyllama.tools.synthetic import size_config
from cosyllama.vocoder import HiFT, source_noise_state

TOKEN_RATE = 25  # speech tokens per second
MEL_RATE = 50  # mel frames per second

# Spec §1.2 / §15: the shipped cosyvoice3.yaml sizes, as `cosyllama make-model --size full` writes them.
_FULL = size_config("full")
FULL_FLOW, FULL_HIFT, FEAT = _FULL.flow, _FULL.hift, _FULL.feat


def mel_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.double().cpu() - b.double().cpu()).abs()
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max())}


class FlowVariant:
    """One way of running the flow: ``run(token, prompt_token, prompt_feat, emb, streaming, finalize)``."""

    def __init__(self, name: str, flow: Flow):
        self.name, self.flow = name, flow
        self.steps = 10
        self.solver = None
        self.autocast = False
        if name.startswith("bf16-steps"):
            self.steps = int(name[len("bf16-steps"):])
            self.precision = "bf16"
        elif name in ("fp32", "bf16", "int8"):
            self.precision = name
        elif name == "fp32-autocast":  # issue 19's baseline: the reference path under plain CPU autocast
            self.precision, self.autocast = "fp32", True
        elif name == "fp32-fast":
            self.precision, self.solver = "fp32", FastDiT(flow.decoder.estimator, torch.float32)
        elif name == "bf16-res16":
            self.precision = "fp32"
            self.solver = FastDiT(flow.decoder.estimator, torch.bfloat16)
            self.solver.residual_dtype = torch.bfloat16  # the variant measured here only
        else:
            raise SystemExit(f"unknown flow variant {name!r}")

    @torch.inference_mode()
    def run(self, token, prompt_token, prompt_feat, emb, streaming=False, finalize=True) -> torch.Tensor:
        flow = self.flow
        if flow.precision != resolve_precision(self.precision):  # switching re-packs the bf16 weights
            flow.set_precision(self.precision)
        flow.decoder.n_timesteps = self.steps
        try:
            if self.solver is None:
                with torch.autocast(flow.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    return flow.inference(token, prompt_token, prompt_feat, emb, streaming=streaming,
                                          finalize=finalize)
            inp = flow.prepare(token, prompt_token, prompt_feat, emb, finalize)
            dec = flow.decoder
            x = self.solver.solve_from(dec.rand_noise[:, :, :inp.mu.shape[2]], inp.mu, inp.spks, inp.cond,
                                       dec.time_grid(), dec.cfg_rate, streaming)
            return x[:, :, inp.prompt_frames:]
        finally:
            flow.decoder.n_timesteps = 10


def profile_flow(variant: FlowVariant, args) -> dict:
    """Share of one flow call's self CPU time per kind of op."""
    kinds = {"gemm": ("addmm", "mm", "bmm", "linear_pointwise", "matmul", "linear"),
             "attention": ("scaled_dot_product", "flash_attention"),
             "conv": ("convolution", "conv1d", "conv2d")}
    with torch.profiler.profile() as prof:
        variant.run(*args)
    tot: dict[str, float] = {"gemm": 0.0, "attention": 0.0, "conv": 0.0, "glue": 0.0}
    for ev in prof.key_averages():
        kind = next((k for k, keys in kinds.items() if any(s in ev.key for s in keys)), "glue")
        tot[kind] += ev.self_cpu_time_total / 1e6
    all_s = sum(tot.values()) or 1.0
    return {k: round(v / all_s, 3) for k, v in tot.items()}


def set_vocoder(hift: HiFT, name: str) -> None:
    """``fp32`` / ``bf16``: the fast conv stack; a ``-ref`` suffix: the reference path."""
    precision, _, path = name.partition("-")
    if path not in ("", "ref") or precision not in ("fp32", "bf16"):
        raise SystemExit(f"unknown vocoder variant {name!r}")
    hift.fast = path != "ref"
    hift.set_precision(precision)


def profile_vocoder(hift: HiFT, name: str, mel: torch.Tensor) -> dict:
    """Share of one vocoder call's self CPU time per kind of op."""
    kinds = {"f0_float64": ("_slow_conv2d",), "conv": ("convolution", "conv1d", "conv2d"),
             "stft": ("fft", "stft"), "sin": ("aten::sin",), "reorder/copy/pad": ("copy_", "fill_", "pad", "cat")}
    set_vocoder(hift, name)
    with torch.profiler.profile() as prof:
        hift.inference(mel)
    tot: dict[str, float] = {k: 0.0 for k in [*kinds, "other elementwise/glue"]}
    for ev in prof.key_averages():
        kind = next((k for k, keys in kinds.items() if any(s in ev.key for s in keys)), "other elementwise/glue")
        tot[kind] += ev.self_cpu_time_total / 1e6
    all_s = sum(tot.values()) or 1.0
    return {k: round(v / all_s, 3) for k, v in tot.items()}


def stream_mel_chunks(frames: int, token_mel_ratio: int = 2, token_hop: int = 25) -> list[int]:
    """New mel frames per streaming call for ``frames`` of mel, on the engine's schedule (hop 25
    tokens doubling to 100, 3 look-ahead tokens, prompt already a multiple of 25); the last entry
    is the finalizing call."""
    from cosyllama.engine import HOP_GROWTH, MAX_HOP_CHUNKS

    tokens, offset, hop, chunks = frames // token_mel_ratio, 0, token_hop, []
    while tokens - offset >= hop + 3:
        chunks.append(token_mel_ratio * hop)
        offset, hop = offset + hop, min(MAX_HOP_CHUNKS * token_hop, HOP_GROWTH * hop)
    return chunks + [frames - token_mel_ratio * offset]


def time_vocoder_stream(hift: HiFT, mel: torch.Tensor, dev: torch.device) -> dict:
    """Vocoder seconds of one streaming synthesis: re-running on all mel so far (the reference
    scheme) vs :meth:`HiFT.stream_step`, and the largest difference between what they emit."""
    chunks = stream_mel_chunks(mel.shape[2])
    out: dict = {"chunks": chunks}
    wavs = {}
    for mode in ("rerun", "stream_step"):
        sync(dev)
        t0, pos, pieces, emitted = time.perf_counter(), 0, [], 0
        st = hift.new_stream()
        for k, c in enumerate(chunks):
            final = k == len(chunks) - 1
            if mode == "rerun":
                wav = hift.inference(mel[:, :, :pos + c], finalize=final)
                pieces.append(wav[:, emitted:])
                emitted = wav.shape[1]
            else:
                pieces.append(hift.stream_step(st, mel[:, :, pos:pos + c], final))
            pos += c
        sync(dev)
        out[f"{mode}_s"] = time.perf_counter() - t0
        wavs[mode] = torch.cat(pieces, dim=1)
    out["max_abs_diff"] = float((wavs["rerun"] - wavs["stream_step"]).abs().max())
    return out


def first_chunk_time(flow: Flow, hift: HiFT, tokens: list[int], prompt, sample_rate: int) -> tuple[float, int]:
    """Seconds until :meth:`Token2Wav.stream` yields its first chunk when all tokens are ready."""
    from cosyllama.engine import Token2Wav

    t2w = Token2Wav(flow, hift, sample_rate)
    t0 = time.perf_counter()
    for chunk in t2w.stream(iter(tokens), prompt, segment=0):
        return time.perf_counter() - t0, chunk.samples.size
    return float("nan"), 0


class _TimedFlow:
    """Delegates to a :class:`Flow`, timing each ``inference`` call and the cache size after it."""

    def __init__(self, flow: Flow, dev: torch.device):
        self.flow, self.dev, self.calls = flow, dev, []

    def __getattr__(self, name):
        return getattr(self.flow, name)

    def inference(self, *args, **kw):
        w, c, out = timed(lambda: self.flow.inference(*args, **kw), self.dev)
        cache = kw.get("cache")
        self.calls.append({"n_tokens": args[0].shape[1], "finalize": kw["finalize"], "wall_s": round(w, 3),
                           "cpu_s": round(c, 3), "reused_frames": cache.last_start if cache else 0,
                           "cache_mb": round(cache.nbytes / 2**20, 1) if cache else 0.0})
        return out


class _NullVocoder:
    """Stands in for the streaming vocoder so that only the flow is timed; keeps all mel it got."""

    def __init__(self, sample_rate: int, hop: int = 480):
        self.hop, self.mel = hop, None

    def new_stream(self) -> None:
        self.mel = None

    def stream_step(self, state, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        self.mel = mel if self.mel is None else torch.cat([self.mel, mel], dim=2)
        return torch.zeros(1, mel.shape[2] * self.hop)


def stream_flow_once(flow: Flow, dev: torch.device, tokens: list[int], prompt, cache_mb: float) -> dict:
    """One streaming synthesis through :class:`Token2Wav` (flow only): per-call times and the mel."""
    from cosyllama.engine import Token2Wav

    timed, voc = _TimedFlow(flow, dev), _NullVocoder(FULL_HIFT.sampling_rate)
    for _ in Token2Wav(timed, voc, FULL_HIFT.sampling_rate, stream_cache_mb=cache_mb).stream(iter(tokens), prompt, 0):
        pass
    calls = timed.calls
    return {"total_s": round(sum(c["wall_s"] for c in calls), 3), "first_chunk_s": calls[0]["wall_s"],
            "total_cpu_s": round(sum(c["cpu_s"] for c in calls), 3),
            "final_s": calls[-1]["wall_s"], "non_final_s": round(sum(c["wall_s"] for c in calls[:-1]), 3),
            "peak_cache_mb": max(c["cache_mb"] for c in calls), "calls": calls, "mel": voc.mel}


def stream_cache_compare(flow: Flow, dev: torch.device, precisions: list[str], tokens: list[int], prompt,
                         repeats: int) -> list[dict]:
    """Streaming flow time with the per-request cache (default bound) and without, per precision,
    the two interleaved round by round (order alternating)."""
    from cosyllama.flow import DEFAULT_STREAM_CACHE_MB

    rows = []
    for prec in precisions:
        flow.set_precision(prec)
        stream_flow_once(flow, dev, tokens[:60], prompt, DEFAULT_STREAM_CACHE_MB)  # warm-up (cached path)
        runs: dict[str, list[dict]] = {"recompute": [], "cache": []}
        for r in range(repeats):
            for name in (("recompute", "cache") if r % 2 == 0 else ("cache", "recompute")):
                run = stream_flow_once(flow, dev, tokens, prompt, DEFAULT_STREAM_CACHE_MB if name == "cache" else 0)
                runs[name].append(run)
                print(f"  round {r} stream flow {prec} {name:9s} total {run['total_s']:7.2f} s "
                      f"({run['total_cpu_s']:7.2f} cpu s), first chunk "
                      f"{run['first_chunk_s']:6.2f} s, final {run['final_s']:6.2f} s, calls "
                      f"{[c['wall_s'] for c in run['calls']]}", flush=True)
        med = {k: {f: statistics.median(run[f] for run in v) for f in ("total_s", "first_chunk_s", "final_s",
                                                                        "non_final_s", "total_cpu_s")}
               for k, v in runs.items()}
        # Best: per call, the fastest round (the same work every round), summed: the estimate least
        # disturbed by other load on a shared machine.
        best = {k: {"calls_s": [min(run["calls"][i]["wall_s"] for run in v) for i in range(len(v[0]["calls"]))]}
                for k, v in runs.items()}
        for b in best.values():
            b.update(total_s=round(sum(b["calls_s"]), 3), non_final_s=round(sum(b["calls_s"][:-1]), 3),
                     first_chunk_s=b["calls_s"][0], final_s=b["calls_s"][-1])
        d = (runs["cache"][-1]["mel"].double() - runs["recompute"][-1]["mel"].double()).abs()
        rows.append({"precision": prec, "repeats": repeats, "recompute": med["recompute"], "cache": med["cache"],
                     "total_speedup": med["recompute"]["total_s"] / med["cache"]["total_s"],
                     "non_final_speedup": med["recompute"]["non_final_s"] / med["cache"]["non_final_s"],
                     "total_cpu_speedup": med["recompute"]["total_cpu_s"] / med["cache"]["total_cpu_s"],
                     "best": best, "best_total_speedup": best["recompute"]["total_s"] / best["cache"]["total_s"],
                     "best_non_final_speedup": best["recompute"]["non_final_s"] / best["cache"]["non_final_s"],
                     "total_ratios_per_round": [round(a["total_s"] / b["total_s"], 3)
                                                for a, b in zip(runs["recompute"], runs["cache"])],
                     "peak_cache_mb": runs["cache"][-1]["peak_cache_mb"],
                     "mel_cache_vs_recompute": {"mean_abs": float(d.mean()), "max_abs": float(d.max())},
                     "calls": {k: [c for c in v[-1]["calls"]] for k, v in runs.items()}})
    return rows


def print_stream_cache(rows: list[dict], audio_s: float, prompt_s: float, threads: int) -> None:
    print(f"\nstreaming flow, {prompt_s:.1f} s prompt + {audio_s:.1f} s, {threads} threads, load "
          f"{os.getloadavg()[0]:.1f}: recompute (reference) vs per-request K/V cache (medians)")
    print(f"  {'precision':9s} {'total rec':>9s} {'total cache':>11s} {'speedup':>7s} {'non-final':>17s} "
          f"{'final':>6s} {'1st chunk rec/cache':>20s} {'peak MB':>8s} {'mel max diff':>12s} {'cpu speedup':>11s}")
    for row in rows:
        rec, cac = row["recompute"], row["cache"]
        print(f"  {row['precision']:9s} {rec['total_s']:9.2f} {cac['total_s']:11.2f} {row['total_speedup']:7.2f} "
              f"{rec['non_final_s']:7.2f} -> {cac['non_final_s']:6.2f} {cac['final_s']:6.2f} "
              f"{rec['first_chunk_s']:9.2f} / {cac['first_chunk_s']:7.2f} {row['peak_cache_mb']:8.0f} "
              f"{row['mel_cache_vs_recompute']['max_abs']:12.2e} {row['total_cpu_speedup']:11.2f}")
    print("  best of rounds per call (summed):")
    for row in rows:
        rec, cac = row["best"]["recompute"], row["best"]["cache"]
        print(f"  {row['precision']:9s} {rec['total_s']:9.2f} {cac['total_s']:11.2f} {row['best_total_speedup']:7.2f} "
              f"{rec['non_final_s']:7.2f} -> {cac['non_final_s']:6.2f} {cac['final_s']:6.2f} "
              f"{rec['first_chunk_s']:9.2f} / {cac['first_chunk_s']:7.2f}   non-final speedup "
              f"{row['best_non_final_speedup']:.2f}")


def summary(walls: list[float], cpus: list[float], audio_s: float) -> dict:
    return {"seconds_per_audio_second": statistics.median(walls) / audio_s,
            "best_seconds_per_audio_second": min(walls) / audio_s,
            "cpu_seconds_per_audio_second": statistics.median(cpus) / audio_s,
            "wall_s": walls, "cpu_s": cpus}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--prompt-s", type=float, default=3.0, help="prompt length in seconds (default 3)")
    ap.add_argument("--out-s", type=float, default=10.0, help="generated audio in seconds (default 10)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved timing rounds; median and best kept")
    ap.add_argument("--flow-variants", default="fp32,bf16", help="comma list (see the module doc)")
    ap.add_argument("--vocoder-variants", default="fp32,bf16",
                    help="comma list: fp32, bf16, fp32-ref, bf16-ref")
    ap.add_argument("--profile", action="store_true", help="also split one flow call per variant by op kind")
    ap.add_argument("--vocoder-profile", action="store_true", help="also split one vocoder call per variant")
    ap.add_argument("--vocoder-repeats", type=int, help="vocoder timing rounds (default: --repeats)")
    ap.add_argument("--vocoder-stream", action="store_true",
                    help="also time the vocoder work of a streaming synthesis: re-run vs stream_step (fp32)")
    ap.add_argument("--stream", action="store_true", help="also time the first streaming chunk per variant")
    ap.add_argument("--stream-cache", action="store_true",
                    help="also time a streaming synthesis's flow calls with and without the K/V cache")
    ap.add_argument("--only-stream-cache", action="store_true", help="only that (no other timing)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    dev = resolve_device(a.device)
    torch.manual_seed(0)  # only the random weights; the modules' own noise uses private generators
    flow = Flow(FULL_FLOW).to(dev).eval()
    hift = HiFT(FULL_HIFT, source_noise_state(FULL_FLOW, FULL_HIFT)).to(dev).eval()
    n_flow = sum(p.numel() for p in flow.parameters())
    n_hift = sum(p.numel() for p in hift.parameters())

    p_tok, o_tok = round(a.prompt_s * TOKEN_RATE), round(a.out_s * TOKEN_RATE)
    prompt_token = torch.randint(0, FULL_FLOW.vocab_size, (1, p_tok))
    token = torch.randint(0, FULL_FLOW.vocab_size, (1, o_tok))
    prompt_feat = torch.randn(1, 2 * p_tok, 80) - 5.0
    emb = torch.randn(1, 192)
    audio_s = o_tok / TOKEN_RATE
    inputs = (token, prompt_token, prompt_feat, emb)

    fvars = [FlowVariant(n.strip(), flow) for n in a.flow_variants.split(",") if n.strip()]
    vnames = [n.strip() for n in a.vocoder_variants.split(",") if n.strip()]
    if not a.only_stream_cache and ("fp32" not in [v.name for v in fvars] or "fp32" not in vnames):
        raise SystemExit("fp32 must be among the variants: fidelity is measured against it")

    # Warm-up on a short input (allocator, oneDNN kernel selection, bf16 weight copies).
    for v in fvars:
        v.run(token[:, :10], prompt_token[:, :10], prompt_feat[:, :20], emb)
    from cosyllama.engine import FlowPrompt

    cache_precisions = [v.name for v in fvars if v.name in ("fp32", "bf16", "int8")]
    stream_prompt = FlowPrompt(prompt_token.int(), prompt_feat, emb)
    if a.only_stream_cache:
        rows = stream_cache_compare(flow, dev, cache_precisions, token[0].tolist(), stream_prompt, a.repeats)
        print_stream_cache(rows, audio_s, p_tok / TOKEN_RATE, a.threads)
        result = {"machine": {"threads": a.threads, "device": str(dev), "loadavg_at_end": os.getloadavg()},
                  "stream_cache": rows}
        print(json.dumps(result))
        if a.json:
            a.json.write_text(json.dumps(result, indent=2))
        return
    for name in vnames:
        set_vocoder(hift, name)
        hift.inference(torch.randn(1, 80, 20, device=dev) - 5.0)

    # Flow: interleaved rounds.
    f_wall = {v.name: [] for v in fvars}
    f_cpu = {v.name: [] for v in fvars}
    mels: dict[str, torch.Tensor] = {}
    for r in range(a.repeats):
        for v in (fvars if r % 2 == 0 else fvars[::-1]):
            w, c, mel = timed(lambda: v.run(*inputs), dev)
            f_wall[v.name].append(round(w, 3))
            f_cpu[v.name].append(round(c, 3))
            mels[v.name] = mel
            print(f"  round {r} flow {v.name:12s} {w:7.2f} s wall {c:7.2f} s cpu", flush=True)
    ref_mel = mels["fp32"]
    # The vocoder is fed the fp32 flow's mel (noise-like with random weights, but the real shapes).
    v_wall = {n: [] for n in vnames}
    v_cpu = {n: [] for n in vnames}
    wavs: dict[str, torch.Tensor] = {}
    for r in range(a.vocoder_repeats or a.repeats):
        for n in (vnames if r % 2 == 0 else vnames[::-1]):
            set_vocoder(hift, n)
            w, c, wav = timed(lambda: hift.inference(ref_mel), dev)
            v_wall[n].append(round(w, 3))
            v_cpu[n].append(round(c, 3))
            wavs[n] = wav
            print(f"  round {r} vocoder {n:9s} {w:7.2f} s wall {c:7.2f} s cpu", flush=True)

    from cosyllama.audio import mel_spectrogram

    ref_wav_mel = mel_spectrogram(wavs["fp32"].float().cpu(), FEAT)
    f_ref = statistics.median(f_wall["fp32"])
    flow_rows = []
    for v in fvars:
        row = {"variant": f"torch-{v.name}-{dev.type}" + (f"-{a.threads}t" if dev.type == "cpu" else ""),
               "precision": v.precision, "n_timesteps": v.steps, **summary(f_wall[v.name], f_cpu[v.name], audio_s),
               "speedup_vs_fp32": f_ref / statistics.median(f_wall[v.name]),
               "cpu_speedup_vs_fp32": statistics.median(f_cpu["fp32"]) / statistics.median(f_cpu[v.name]),
               "mel_vs_fp32": mel_diff(mels[v.name], ref_mel),
               "prompt_s": p_tok / TOKEN_RATE, "audio_s": audio_s, "params": n_flow}
        if a.profile:
            row["time_share"] = profile_flow(v, inputs)
        flow_rows.append(row)
    v_ref = statistics.median(v_wall["fp32"])
    voc_rows = []
    for n in vnames:
        voc_rows.append({"variant": f"torch-{n}-{dev.type}" + (f"-{a.threads}t" if dev.type == "cpu" else ""),
                         "precision": n, **summary(v_wall[n], v_cpu[n], audio_s),
                         "speedup_vs_fp32": v_ref / statistics.median(v_wall[n]),
                         "wav_logmel_vs_fp32": mel_diff(mel_spectrogram(wavs[n].float().cpu(), FEAT), ref_wav_mel),
                         "wav_max_abs_vs_fp32": float((wavs[n].float() - wavs["fp32"].float()).abs().max()),
                         "audio_s": audio_s, "params": n_hift})
        if a.vocoder_profile:
            voc_rows[-1]["time_share"] = profile_vocoder(hift, n, ref_mel)
    voc_stream = []
    if a.vocoder_stream:
        set_vocoder(hift, "fp32")
        for r in range(a.vocoder_repeats or a.repeats):
            voc_stream.append(time_vocoder_stream(hift, ref_mel, dev))
            print(f"  round {r} vocoder stream: re-run {voc_stream[-1]['rerun_s']:.2f} s, stream_step "
                  f"{voc_stream[-1]['stream_step_s']:.2f} s", flush=True)

    stream_rows = []
    if a.stream:
        from cosyllama.engine import FlowPrompt

        prompt = FlowPrompt(prompt_token.int(), prompt_feat, emb)
        toks = token[0].tolist()
        for v in fvars:
            if v.solver is not None or v.steps != 10:
                continue
            flow.set_precision(v.precision)
            set_vocoder(hift, "fp32")
            ttfc, n = first_chunk_time(flow, hift, toks, prompt, FULL_HIFT.sampling_rate)
            stream_rows.append({"flow": v.name, "vocoder": "fp32", "first_chunk_s": ttfc,
                                "first_chunk_audio_s": n / FULL_HIFT.sampling_rate})
        flow.set_precision("fp32")
    cache_rows = []
    if a.stream_cache:
        cache_rows = stream_cache_compare(flow, dev, cache_precisions, token[0].tolist(), stream_prompt, a.repeats)
        flow.set_precision("fp32")

    result = {
        "machine": {"threads": a.threads, "device": str(dev), "loadavg_at_end": os.getloadavg(),
                    "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "flow": flow_rows, "vocoder": voc_rows, "vocoder_stream": voc_stream, "streaming": stream_rows,
        "stream_cache": cache_rows,
    }
    print(f"\nflow ({n_flow / 1e6:.1f} M params, {p_tok / TOKEN_RATE:.1f} s prompt + {audio_s:.1f} s, CFG batch 2), "
          f"{a.threads} threads, load {os.getloadavg()[0]:.1f}")
    print(f"  {'variant':14s} {'s/audio-s':>9s} {'best':>7s} {'cpu s/s':>8s} {'speedup':>8s} {'cpu-spdup':>9s}"
          f" {'mel mean':>9s} {'mel max':>8s}")
    for v, row in zip(fvars, flow_rows):
        print(f"  {v.name:14s} {row['seconds_per_audio_second']:9.3f} {row['best_seconds_per_audio_second']:7.3f} "
              f"{row['cpu_seconds_per_audio_second']:8.3f} {row['speedup_vs_fp32']:8.2f} "
              f"{row['cpu_speedup_vs_fp32']:9.2f} {row['mel_vs_fp32']['mean_abs']:9.4f} "
              f"{row['mel_vs_fp32']['max_abs']:8.4f}" + (f"  {row['time_share']}" if a.profile else ""))
    print(f"vocoder ({n_hift / 1e6:.1f} M params, {audio_s:.1f} s)")
    for n, row in zip(vnames, voc_rows):
        print(f"  {n:14s} {row['seconds_per_audio_second']:9.3f} {row['best_seconds_per_audio_second']:7.3f} "
              f"{row['cpu_seconds_per_audio_second']:8.3f} {row['speedup_vs_fp32']:8.2f} {'':9s} "
              f"{row['wav_logmel_vs_fp32']['mean_abs']:9.4f} {row['wav_logmel_vs_fp32']['max_abs']:8.4f}"
              f"  (log-mel of the waveform; wav max diff {row['wav_max_abs_vs_fp32']:.1e})"
              + (f"  {row['time_share']}" if a.vocoder_profile else ""))
    if voc_stream:
        rr = statistics.median(v["rerun_s"] for v in voc_stream)
        ss = statistics.median(v["stream_step_s"] for v in voc_stream)
        print(f"vocoder work of a streaming synthesis ({len(voc_stream[0]['chunks'])} calls, mel chunks "
              f"{voc_stream[0]['chunks']}): re-run on all mel {rr / audio_s:.3f} s/s, stream_step "
              f"{ss / audio_s:.3f} s/s ({rr / ss:.2f}x), max diff {max(v['max_abs_diff'] for v in voc_stream):.1e}")
    for row in stream_rows:
        print(f"first streaming chunk, flow {row['flow']}: {row['first_chunk_s']:.2f} s "
              f"({row['first_chunk_audio_s']:.2f} s of audio)")
    if cache_rows:
        print_stream_cache(cache_rows, audio_s, p_tok / TOKEN_RATE, a.threads)
    print(json.dumps(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
