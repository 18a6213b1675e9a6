"""The flow and vocoder parts of ``cosyllama bench``.

* ``flow``: one non-streaming flow call per variant (precisions, and the opt-in research variants
  below), each variant's mel against fp32's on the same inputs; ``--profile`` splits one call by
  op kind (torch.profiler); ``--stream`` times one streaming synthesis per variant through the
  engine's :class:`~cosyllama.engine.Token2Wav` (fp32 vocoder), with the per-request flow cache
  and recomputing every chunk: the first chunk, the flow's share, the cache's peak size.
* ``vocoder``: one call per vocoder variant on fp32's mel (``--profile`` as for the flow).
* ``flow-batch`` (opt-in): N equal-length requests solved one after another and as one
  :meth:`~cosyllama.flow.Flow.inference_batch`, per variant and N: does batching concurrent
  flows pay on this device?

Every part times its variants in interleaved rounds (:func:`cosyllama.timing.rounds`) and reports
the medians. Research variants (``--flow-precisions``, never in the defaults): ``fp32-autocast``
(the reference path under plain ``torch.autocast(bfloat16)``: the baseline the bf16 solver was
built to beat), ``bf16-res16`` (the bf16 solver with its residual stream in bfloat16 too: what
keeping it float32 costs), ``<precision>-steps<N>`` (N Euler steps instead of the model's 10: an
explicit quality trade), ``<variant>-torch-attention`` (a bf16 or mixed int8 variant with PyTorch's attention
where the bf16 attention kernel would run: what the kernel gains, cosyllama.flow.native_attention). Vocoder
variants ``fp32-ref`` / ``bf16-ref`` run the module-by-module reference path instead of the channels-last conv
stack.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..progress import LineProgress as Progress
from ..timing import rounds, sync, timed
from .bench_setup import TOKEN_RATE

FLOW_VARIANTS = ("fp32", "bf16", "int8", "int8-onednn")  # the default on the CPU; a GPU has no int8 path
# Bench-only spellings: the int8 solver on a named int8 engine (plain "int8" is fast_dit.INT8_ENGINE's).
ENGINE_VARIANTS = {"int8-onednn": "onednn", "int8-fbgemm": "fbgemm", "int8-onednn+bf16": "onednn+bf16",
                   "int8-onednn+bf16+static": "onednn+bf16+static"}
RESEARCH_VARIANTS = ("fp32-autocast", "bf16-res16", "<precision>-steps<N>", "<variant>-torch-attention")
TORCH_ATTENTION = "-torch-attention"
VOCODER_VARIANTS = ("fp32", "bf16", "fp32-ref", "bf16-ref")
BATCH_SIZES = (1, 2, 4, 8, 16)
# Op kinds of --profile: a profiled op belongs to the first kind one of whose names it contains.
# The flow's kinds tell the int8 products (dynamic and static kernels) from the bf16/fp32 ones and from the passes
# around them (scripts/flow_ceiling.py --parts profile shares them; docs/amx.md has a table per size). The order
# matters: oneDNN's int8 op is "qlinear_pointwise", its bf16 one "linear_pointwise".
FLOW_OP_KINDS = {"int8 products": ("quantized::linear", "qlinear_pointwise"),
                 "quantization passes": ("quantize_per_tensor", "int_repr"),
                 "bf16/fp32 products": ("linear_pointwise", "addmm", "aten::mm", "aten::bmm", "aten::matmul",
                                        "aten::linear"),
                 "attention": ("scaled_dot_product", "flash_attention", "attention_bf16"),
                 "conv": ("convolution", "conv1d", "conv2d"),
                 "dtype conversions": ("aten::to", "aten::_to_copy", "aten::copy_"),
                 "gelu": ("gelu",),
                 "norm/modulation": ("layer_norm", "aten::mul", "aten::add", "aten::addcmul")}
VOCODER_OP_KINDS = {"f0_float64": ("_slow_conv2d",), "conv": ("convolution", "conv1d", "conv2d"),
                    "stft": ("fft", "stft"), "sin": ("aten::sin",), "copy": ("copy_", "fill_", "pad", "cat")}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ----------------------------------------------------------------------------------------------
# Variants


@dataclass(frozen=True)
class FlowVariant:
    """One way of running the flow, parsed from its name (:meth:`parse`)."""

    name: str
    precision: str  # what Flow.set_precision gets
    engine: str | None = None  # the int8 engine of an int8-<engine> variant (None: the default one)
    steps: int | None = None  # Euler steps (None: the model's)
    autocast: bool = False  # the reference path under torch.autocast(bfloat16)
    residual_bf16: bool = False  # the bf16 solver with its residual stream in bfloat16 too
    torch_attention: bool = False  # bf16 attention on PyTorch's kernel, not the bf16 one chosen here

    @classmethod
    def parse(cls, name: str) -> FlowVariant | None:
        """The variant ``name`` spells, or None."""
        from ..defaults import PRECISIONS

        if name in PRECISIONS:
            return cls(name, name)
        if name.endswith(TORCH_ATTENTION):
            base = cls.parse(name[:-len(TORCH_ATTENTION)])
            return None if base is None or base.torch_attention else dataclasses.replace(
                base, name=name, torch_attention=True)
        if name in ENGINE_VARIANTS:
            return cls(name, "int8", engine=ENGINE_VARIANTS[name])
        if name == "fp32-autocast":
            return cls(name, "fp32", autocast=True)
        if name == "bf16-res16":
            return cls(name, "bf16", residual_bf16=True)
        m = re.fullmatch(r"(fp32|bf16|int8)-steps(\d+)", name)
        if m and 1 <= int(m[2]) <= 100:
            return cls(name, m[1], steps=int(m[2]))
        return None

    def available(self) -> bool:
        """Its int8 engine, if it needs one, is in this PyTorch build (and, for the mixed one, bf16 is native)."""
        from ..flow.fast_dit import INT8_ENGINE, int8_engine_problem

        return self.precision != "int8" or int8_engine_problem(self.engine or INT8_ENGINE) is None

    def apply(self, flow) -> None:
        """Switch ``flow`` to this variant (a switch re-packs the weight copies: keep it out of a timing)."""
        from ..flow.check import Candidate
        from ..precision import INT8

        flow.set_precision(self.precision)
        if self.engine:  # a static engine calibrates (or takes its cached scales) here
            Candidate(INT8, self.engine).apply(flow)
        flow.set_n_timesteps(self.steps or flow.cfg.n_timesteps)

    @contextmanager
    def running(self, device: torch.device):
        """Around each call of this variant: the autocast or residual-stream setting it needs."""
        with ExitStack() as stack:
            if self.autocast:
                stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
            if self.torch_attention:
                import os
                from unittest import mock

                from ..flow import native_attention

                stack.enter_context(mock.patch.dict(os.environ, {native_attention.ENV: "pytorch"}))
            if self.residual_bf16:
                from ..flow.fast_dit import FastDiT

                saved = FastDiT.residual_dtype
                FastDiT.residual_dtype = torch.bfloat16
                stack.callback(setattr, FastDiT, "residual_dtype", saved)
            yield


def flow_variants(spec: str | None, device: torch.device, reference: bool = True) -> tuple[str, ...]:
    """The flow variants to time: ``spec`` (a comma list) or the default for ``device``. With
    ``reference`` (the flow part) fp32 is timed first, because every row's fidelity is measured
    against it; without (the flow-batch part, whose rows compare with themselves) the list is as given."""
    from ..defaults import PRECISIONS

    engines = torch.backends.quantized.supported_engines
    if spec is None:
        names = [v for v in FLOW_VARIANTS if device.type == "cpu" or not v.startswith("int8")]
        names = [v for v in names if FlowVariant.parse(v).available()]
    else:
        names = [v.strip().lower() for v in spec.split(",") if v.strip()]
        bad = [v for v in names if FlowVariant.parse(v) is None or not FlowVariant.parse(v).available()]
        if bad or not names:
            allowed = (*PRECISIONS, *ENGINE_VARIANTS, *RESEARCH_VARIANTS)
            raise InputError(f"--flow-precisions {spec!r}: choose from {', '.join(allowed)} "
                             f"(N: 1 to 100; int8 engines in this PyTorch: {', '.join(engines)})")
    names = list(dict.fromkeys(names))
    return tuple(["fp32"] + [v for v in names if v != "fp32"]) if reference else tuple(names)


def vocoder_variants(spec: str | None) -> tuple[str, ...]:
    """The vocoder variants to time (``spec``: a comma list; default fp32, bf16); fp32 first."""
    names = ["fp32", "bf16"] if spec is None else [v.strip().lower() for v in spec.split(",") if v.strip()]
    bad = [v for v in names if v not in VOCODER_VARIANTS]
    if bad or not names:
        raise InputError(f"--vocoder-precisions {spec!r}: choose from {', '.join(VOCODER_VARIANTS)}")
    return tuple(["fp32"] + [v for v in dict.fromkeys(names) if v != "fp32"])


def set_vocoder_variant(hift, name: str) -> None:
    """``fp32`` / ``bf16``: the channels-last conv stack; a ``-ref`` suffix: the reference path."""
    precision, _, path = name.partition("-")
    hift.fast = path != "ref"
    hift.set_precision(precision)


def batch_sizes(spec: str | None) -> tuple[int, ...]:
    """``--batch-sizes``: a comma list of integers >= 1 (default 1,2,4,8,16)."""
    if spec is None:
        return BATCH_SIZES
    try:
        ns = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        ns = ()
    if not ns or min(ns) < 1:
        raise InputError(f"--batch-sizes {spec!r}: a comma list of integers >= 1")
    return tuple(dict.fromkeys(ns))


def _variant_ran(flow) -> str:
    """What the flow runs, its int8 engine included (``int8/onednn``): the name ``auto`` gives its candidates."""
    from ..flow.check import Candidate
    from ..precision import INT8

    return Candidate(flow.precision, flow.decoder.int8_engine if flow.precision == INT8 else None).name


# ----------------------------------------------------------------------------------------------
# Profile and streaming


def op_seconds(fn: Callable[[], object], kinds: dict[str, tuple[str, ...]], device: torch.device) -> dict:
    """Seconds of one call's op time per kind of op (the rest: ``other``): self CPU time on the CPU,
    self device time on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    tot = dict.fromkeys([*kinds, "other"], 0.0)
    for ev in prof.key_averages():
        kind = next((k for k, names in kinds.items() if any(s in ev.key for s in names)), "other")
        tot[kind] += (ev.self_device_time_total if cuda else ev.self_cpu_time_total) / 1e6
    return tot


def op_shares(fn: Callable[[], object], kinds: dict[str, tuple[str, ...]], device: torch.device) -> dict:
    """Share of one call's op time per kind of op (:func:`op_seconds`)."""
    tot = op_seconds(fn, kinds, device)
    total = sum(tot.values()) or 1.0
    return {k: round(v / total, 3) for k, v in tot.items()}


class _TimedFlow:
    """Delegates to a :class:`~cosyllama.flow.Flow`, running each ``inference`` call in the
    variant's setting (``variant.running``), timing it and noting the stream cache's size after it."""

    def __init__(self, flow, variant: FlowVariant, device: torch.device):
        self.flow, self.variant, self.device, self.walls, self.cache_mb = flow, variant, device, [], [0.0]

    def __getattr__(self, name):
        return getattr(self.flow, name)

    def inference(self, *args, **kw):
        with self.variant.running(self.device):
            wall, _, out = timed(lambda: self.flow.inference(*args, **kw), self.device)
        self.walls.append(wall)
        if kw.get("cache") is not None:
            self.cache_mb.append(kw["cache"].nbytes / 2**20)
        return out


def stream_once(config, flow, variant: FlowVariant, hift, tokens: list[int], prompt, device: torch.device,
                cache_mb: float) -> dict:
    """One streaming synthesis of ``tokens`` through :class:`~cosyllama.engine.Token2Wav`, every
    token ready at once, the flow at ``variant`` (already applied): seconds to the first chunk, of
    the flow calls, in all; the flow cache's peak (``cache_mb`` 0: every chunk recomputed); the
    audio. No prompt-frame cache: every run is a first request of its voice."""
    from ..engine import Token2Wav

    tf = _TimedFlow(flow, variant, device)
    t2w = Token2Wav.from_config(config, tf, hift, stream_cache_mb=cache_mb, prompt_cache_mb=0)
    pieces, first = [], None
    sync(device)
    t0 = time.perf_counter()
    for chunk in t2w.stream(iter(tokens), prompt, 0):
        if first is None and chunk.samples.size:
            first = time.perf_counter() - t0
        pieces.append(chunk.samples)
    total = time.perf_counter() - t0
    return {"first_chunk_s": first, "flow_s": sum(tf.walls), "total_s": total, "flow_calls": len(tf.walls),
            "peak_cache_mb": max(tf.cache_mb), "wav": np.concatenate(pieces)}


def _stream_row(runs: dict[str, list[dict]]) -> dict:
    """The medians of a variant's streaming runs, with the cache and recomputing."""
    row = {mode: {k: _median([r[k] for r in rs]) for k in ("first_chunk_s", "flow_s", "total_s")}
           for mode, rs in runs.items()}
    row["flow_calls"] = runs["cache"][-1]["flow_calls"]
    row["peak_cache_mb"] = max(r["peak_cache_mb"] for r in runs["cache"])
    row["wav_max_abs_diff_cache_vs_recompute"] = float(np.abs(runs["cache"][-1]["wav"]
                                                              - runs["recompute"][-1]["wav"]).max())
    return row


# ----------------------------------------------------------------------------------------------
# The parts


def _inputs(config, prompt_s: float, output_s: float, generator: torch.Generator, device: torch.device) -> tuple:
    """Random output tokens, prompt tokens, prompt mel and speaker embedding of the given lengths."""
    p, n = round(prompt_s * TOKEN_RATE), round(output_s * TOKEN_RATE)
    vocab = config.flow.vocab_size
    tokens = torch.randint(0, vocab, (1, n), generator=generator, dtype=torch.int32)
    prompt_tokens = torch.randint(0, vocab, (1, p), generator=generator, dtype=torch.int32)
    prompt_feat = torch.randn(1, 2 * p, 80, generator=generator) - 5
    emb = torch.randn(1, 192, generator=generator)
    return tuple(t.to(device) for t in (tokens, prompt_tokens, prompt_feat, emb))


def run_flow_vocoder(model_dir: Path, prompt_s: float, output_s: float, repeat: int, parts: set[str],
                     progress: Progress, device: torch.device = torch.device("cpu"),
                     variants: tuple[str, ...] | None = None, vocoder_names: tuple[str, ...] = ("fp32", "bf16"),
                     profile: bool = False, stream: bool = False) -> tuple[list[dict], list[dict]]:
    """Flow per variant (fidelity vs fp32 on the same inputs; ``auto`` runs its fidelity check
    first and says what it chose), then the vocoder per variant on fp32's mel."""
    from ..config import load_config
    from ..engine import FlowPrompt
    from ..flow import DEFAULT_STREAM_CACHE_MB, Flow
    from ..vocoder import HiFT

    config = load_config(model_dir)
    inputs = _inputs(config, prompt_s, output_s, torch.Generator().manual_seed(0), device)
    tokens, prompt_tokens, prompt_feat, emb = inputs
    flow = Flow.from_config(config, device)
    hift = HiFT.from_config(config, device) if "vocoder" in parts or stream else None
    names = list(variants or flow_variants(None, device)) if "flow" in parts else ["fp32"]
    stream = stream and "flow" in parts
    parsed = {v: FlowVariant.parse(v) for v in names}
    ran: dict[str, str] = {}
    secs: dict[str, list[float]] = {v: [] for v in names}
    cpus: dict[str, list[float]] = {v: [] for v in names}
    streams: dict[str, dict[str, list[dict]]] = {v: {"cache": [], "recompute": []} for v in names}
    mels: dict[str, torch.Tensor] = {}
    prompt = FlowPrompt(prompt_tokens, prompt_feat, emb)
    for variant in rounds(names, repeat if "flow" in parts else 1):  # vocoder alone: fp32's mel, once
        v = parsed[variant]
        if len(names) > 1 or variant not in ran:
            t0 = time.perf_counter()
            v.apply(flow)  # a switch re-packs the weight copies: outside the timing
            setup = time.perf_counter() - t0
            with v.running(device):
                flow.inference(tokens[:, :10], prompt_tokens, prompt_feat, emb)  # warm up
            if stream and variant not in ran:  # and once the streaming calls' shapes
                stream_once(config, flow, v, hift, tokens[0, :60].tolist(), prompt, device, DEFAULT_STREAM_CACHE_MB)
        if variant not in ran:
            ran[variant] = _variant_ran(flow)
            if variant == "auto":
                progress(f"flow auto -> {ran[variant]} ({flow.precision_choice.reason}; set-up {setup:.1f} s)")
        with v.running(device):
            t, c, mels[variant] = timed(lambda: flow.inference(tokens, prompt_tokens, prompt_feat, emb), device)
        if stream:
            for mode, mb in (("cache", DEFAULT_STREAM_CACHE_MB), ("recompute", 0)):
                streams[variant][mode].append(stream_once(config, flow, v, hift, tokens[0].tolist(), prompt,
                                                          device, mb))
        secs[variant].append(t)
        cpus[variant].append(c)
        if "flow" in parts:
            progress(f"flow {variant}: {t / output_s:.3f} s per audio second")
    mel_ref = mels["fp32"]
    flow_rows = []
    if "flow" in parts:
        for variant in names:
            diff = (mels[variant] - mel_ref).abs()
            row = {"variant": variant if variant != "auto" else f"auto={ran[variant]}",
                   "seconds_per_audio_second": _median(secs[variant]) / output_s,
                   "cpu_seconds_per_audio_second": _median(cpus[variant]) / output_s,
                   "rounds_seconds_per_audio_second": [t / output_s for t in secs[variant]],
                   "mel_mean_abs_diff_vs_fp32": float(diff.mean()),
                   "mel_max_abs_diff_vs_fp32": float(diff.max())}
            progress(f"flow {variant}: median {row['seconds_per_audio_second']:.3f} s per audio second "
                     f"(mel vs fp32: mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f})")
            if stream:
                row["stream"] = _stream_row(streams[variant])
            if profile:
                parsed[variant].apply(flow)
                with parsed[variant].running(device):
                    row["time_share"] = op_shares(
                        lambda: flow.inference(tokens, prompt_tokens, prompt_feat, emb), FLOW_OP_KINDS, device)
            flow_rows.append(row)
    flow = None  # its weights and copies freed before the vocoder runs
    voc_rows = []
    if "vocoder" in parts:
        vnames = list(vocoder_names)
        vsecs: dict[str, list[float]] = {v: [] for v in vnames}
        vcpus: dict[str, list[float]] = {v: [] for v in vnames}
        wavs: dict[str, torch.Tensor] = {}
        for variant in rounds(vnames, repeat):
            set_vocoder_variant(hift, variant)
            hift.inference(mel_ref[:, :, :20])
            t, c, wavs[variant] = timed(lambda: hift.inference(mel_ref), device)
            vsecs[variant].append(t)
            vcpus[variant].append(c)
        for variant in vnames:
            sps = _median(vsecs[variant]) / output_s
            row = {"variant": variant, "seconds_per_audio_second": sps,
                   "cpu_seconds_per_audio_second": _median(vcpus[variant]) / output_s,
                   "rounds_seconds_per_audio_second": [t / output_s for t in vsecs[variant]],
                   "wav_max_abs_diff_vs_fp32": float((wavs[variant] - wavs["fp32"]).abs().max())}
            if profile:
                set_vocoder_variant(hift, variant)
                row["time_share"] = op_shares(lambda: hift.inference(mel_ref), VOCODER_OP_KINDS, device)
            voc_rows.append(row)
            progress(f"vocoder {variant}: {sps:.3f} s per audio second")
    return flow_rows, voc_rows


def run_flow_batch(model_dir: Path, prompt_s: float, output_s: float, repeat: int, progress: Progress,
                   device: torch.device = torch.device("cpu"), variants: tuple[str, ...] = ("fp32",),
                   sizes: tuple[int, ...] = BATCH_SIZES) -> list[dict]:
    """Per variant and N: N requests of one prompt and their own output tokens (equal lengths),
    solved one after another (what concurrent requests get) and as one batch (each row still has its
    own CFG pair, so the DiT sees 2N rows); seconds per request both ways and the largest difference
    of the batched mels from the others (float rounding only: the rows share no arithmetic)."""
    from ..config import load_config
    from ..flow import Flow

    config = load_config(model_dir)
    g = torch.Generator().manual_seed(0)
    reqs = [_inputs(config, prompt_s, output_s, g, device) for _ in range(max(sizes))]
    reqs = [(r[0], *reqs[0][1:]) for r in reqs]  # one voice: every request takes the first one's prompt
    flow = Flow.from_config(config, device)
    rows = []
    for variant in variants:
        v = FlowVariant.parse(variant)
        v.apply(flow)
        with v.running(device):
            flow.inference(*reqs[0])  # warm up: weight packing, kernels
            for n in sizes:
                batch = reqs[:n]
                flow.inference_batch(batch)  # warm up this batch shape
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times: dict[str, list[float]] = {"serial": [], "batched": []}
                out = {}
                for way in rounds(["serial", "batched"], repeat):
                    fn = (lambda: [flow.inference(*r) for r in batch]) if way == "serial" else (
                        lambda: flow.inference_batch(batch))
                    t, _, out[way] = timed(fn, device)
                    times[way].append(t / n)
                diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(out["batched"], out["serial"]))
                row = {"variant": variant, "n": n, "serial_s_per_request": _median(times["serial"]),
                       "batched_s_per_request": _median(times["batched"]),
                       "speedup": _median(times["serial"]) / _median(times["batched"]),
                       "max_abs_diff_batched_vs_serial": diff, "rounds_serial_s_per_request": times["serial"],
                       "rounds_batched_s_per_request": times["batched"]}
                if device.type == "cuda":
                    row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
                rows.append(row)
                progress(f"flow batch {variant} N={n}: one after another {row['serial_s_per_request']:.3f} s "
                         f"per request, batched {row['batched_s_per_request']:.3f} s ({row['speedup']:.2f}x)")
    return rows


# ----------------------------------------------------------------------------------------------
# Table


def format_lines(res: dict) -> list[str]:
    """The table lines of the flow, vocoder and flow-batch parts."""
    m = res["machine"]
    lines = [""] if res["flow"] or res["vocoder"] else []
    base = next((r["seconds_per_audio_second"] for r in res["flow"] if r["variant"] == "fp32"), None)
    w = max([5] + [len(r["variant"]) + 1 for r in res["flow"] + res["vocoder"] + res.get("flow_batch", [])])
    for r in res["flow"]:
        native = "" if "bf16" not in r["variant"] or m.get("device", "cpu") != "cpu" or m.get("native_bf16", True) \
            else " [bf16 emulated on this CPU: auto does not pick it]"
        ratio = f" {base / r['seconds_per_audio_second']:.2f}x fp32" if base and r["variant"] != "fp32" else ""
        lines.append(f"flow {r['variant']:<{w}} {r['seconds_per_audio_second']:.3f} s per second of audio{ratio} "
                     f"(mel vs fp32: mean {r['mel_mean_abs_diff_vs_fp32']:.4f}, "
                     f"max {r['mel_max_abs_diff_vs_fp32']:.4f})" + native)
    for r in res["vocoder"]:
        lines.append(f"vocoder {r['variant']:<{w}} {r['seconds_per_audio_second']:.3f} s per second of audio "
                     f"(wav vs fp32: max {r['wav_max_abs_diff_vs_fp32']:.4f})")
    streamed = [r for r in res["flow"] if "stream" in r]
    if streamed:
        lines += ["", "streaming (fp32 vocoder), seconds with the flow cache / recomputing every chunk",
                  f"{'flow':<{w}}{'first chunk':>14}{'flow calls':>14}{'all':>14}{'calls':>7}{'cache MB':>10}"
                  f"{'wav diff':>10}"]
        for r in streamed:
            s = r["stream"]
            cells = ["/".join("-" if s[k][f] is None else f"{s[k][f]:.2f}" for k in ("cache", "recompute"))
                     for f in ("first_chunk_s", "flow_s", "total_s")]
            diff = s["wav_max_abs_diff_cache_vs_recompute"]
            lines.append(f"{r['variant']:<{w}}" + "".join(f"{c:>14}" for c in cells)
                         + f"{s['flow_calls']:>7}{s['peak_cache_mb']:>10.0f}{diff:>10.1e}")
    profiled = [("flow", r) for r in res["flow"] if "time_share" in r] + [
        ("vocoder", r) for r in res["vocoder"] if "time_share" in r]
    if profiled:
        lines += ["", f"op time shares of one call ({'device' if m.get('device', 'cpu') != 'cpu' else 'CPU'} time)"]
        for part, r in profiled:
            shares = "  ".join(f"{k} {v:.2f}" for k, v in r["time_share"].items())
            lines.append(f"{part:<8}{r['variant']:<{w}}{shares}")
    if res.get("flow_batch"):
        lines += ["", "flow batch: N equal-length requests, one after another vs one batch (s per request)",
                  f"{'flow':<{w}}{'N':>4}{'one by one':>12}{'batched':>10}{'speed-up':>10}{'max diff':>10}"]
        for r in res["flow_batch"]:
            lines.append(f"{r['variant']:<{w}}{r['n']:>4}{r['serial_s_per_request']:>12.3f}"
                         f"{r['batched_s_per_request']:>10.3f}{r['speedup']:>9.2f}x"
                         f"{r['max_abs_diff_batched_vs_serial']:>10.1e}")
    return lines
