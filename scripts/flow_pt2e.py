"""PyTorch's own int8 route for the flow, measured beside cosyllama's solvers: the DiT exported
(``torch.export``), quantized with torchao's PT2E X86 inductor quantizer (int8 products with
per-channel weights; activation scales static, calibrated once, or dynamic, per call) and compiled
by inductor with freezing, whose fused int8 kernels requantize in the products' epilogues.

    python scripts/flow_pt2e.py --threads 2 [--quantization static,dynamic] [--scope blocks|linear|all] [--json FILE]

One process, one whole flow call (3 s prompt + 10 s by default) per row, rows in turns: cosyllama's
bf16 and int8/onednn+bf16 solvers, then per quantization scheme the PT2E DiT on every Euler step
(``pt2e-<scheme>``) and on all but the last two, which run the inductor-compiled bf16 DiT
(``pt2e-<scheme>+2bf16``, the tail cosyllama's int8 solvers keep in higher precision), plus the
inductor bf16 DiT alone.

``--scope``: ``blocks`` (the default) quantizes only the products inside the DiT blocks, the ones
cosyllama's int8 solvers quantize (the time MLP, modulations and the input and output projections
stay float); ``linear`` every linear layer of the DiT; ``all`` every op the quantizer knows.

Mel error against the float32 solve of the same inputs; static scales are calibrated on a whole solve
of other random inputs. The export is specialised to the call's frame count: another length needs a
new export, calibration and compile (the setup times are reported).

Needs ``pip install torchao`` (not a cosyllama dependency). Numbers: docs/performance-notes.md#pytorchs-int8-route-pt2e.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

SCHEMES = ("static", "dynamic")
SCOPES = ("blocks", "linear", "all")
# The DiT block products cosyllama's int8 solvers quantize (module names within a block)
BLOCK_PRODUCTS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.ff.0.0", "ff.ff.2")
TAIL_STEPS = 2


class _Estimator(torch.nn.Module):
    """The DiT with the positional signature torch.export needs (non-streaming, no cache)."""

    def __init__(self, dit: torch.nn.Module):
        super().__init__()
        self.dit = dit

    def forward(self, x, mu, t, spks, cond):
        return self.dit(x, mu, t, spks, cond)


class _Steps(torch.nn.Module):
    """Stands in for the flow's estimator: Euler step i of each solve runs ``first`` (i < steps - tail)
    or ``tail``, under bf16 autocast when asked."""

    def __init__(self, dit, steps: int, first, tail, tail_steps: int, autocast: bool):
        super().__init__()
        self.first, self.tail, self.steps, self.tail_steps, self.autocast = first, tail, steps, tail_steps, autocast
        self.static_chunk_size, self.transformer_blocks = dit.static_chunk_size, dit.transformer_blocks
        self.calls = 0

    def forward(self, x, mu, t, spks, cond, streaming=False, past=None):
        i = self.calls % self.steps
        self.calls += 1
        module = self.first if i < self.steps - self.tail_steps else self.tail
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return module(x, mu, t, spks, cond).float()


def _example(frames: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 80, frames, generator=g), torch.randn(2, 80, frames, generator=g),
            torch.tensor([0.3, 0.3]), torch.randn(2, 80, generator=g), torch.randn(2, 80, frames, generator=g))


def quantized_dit(flow, scheme: str, scope: str, frames: int, calibration: tuple):
    """The flow's DiT exported at ``frames``, PT2E-quantized (``scheme``, over ``scope``), calibrated
    on a whole solve of ``calibration`` (static scales), compiled; with the seconds each phase took."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    cfm = flow.decoder
    dit = cfm.estimator
    t0 = time.perf_counter()
    exported = torch.export.export(_Estimator(dit).eval(), _example(frames)).module()
    quantizer = xiq.X86InductorQuantizer()
    qconfig = xiq.get_default_x86_inductor_quantization_config(is_dynamic=scheme == "dynamic")
    if scope == "all":
        quantizer.set_global(qconfig)
    elif scope == "linear":
        quantizer.set_module_type_qconfig(torch.nn.Linear, qconfig)
    else:
        for name, _ in dit.named_modules():
            if name.startswith("transformer_blocks.") and name.split(".", 2)[-1] in BLOCK_PRODUCTS:
                quantizer.set_module_name_qconfig(f"dit.{name}", qconfig)
    prepared = prepare_pt2e(exported, quantizer)
    flow.set_precision("fp32")
    cfm.estimator = _Steps(dit, cfm.n_timesteps, prepared, prepared, 0, False)
    try:
        flow.inference(*calibration)  # the observers see every Euler step of a solve
    finally:
        cfm.estimator = dit
    compiled = torch.compile(convert_pt2e(prepared))
    t1 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(*_example(frames))
    return compiled, {"export_calibrate_s": round(t1 - t0, 1), "compile_s": round(time.perf_counter() - t1, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="model directory (default: the cached full-size random model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantization", default=",".join(SCHEMES), help="comma list of static, dynamic")
    p.add_argument("--scope", choices=SCOPES, default="blocks", help="ops to quantize (see above)")
    p.add_argument("--prompt-seconds", type=float, default=3.0)
    p.add_argument("--output-seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    schemes = [s.strip() for s in args.quantization.split(",") if s.strip()]
    if not schemes or any(s not in SCHEMES for s in schemes):
        p.error(f"--quantization: a comma list of {', '.join(SCHEMES)}")
    try:
        import torchao  # noqa: F401
    except ImportError:
        p.exit(2, "flow_pt2e.py needs torchao (PT2E quantization lives there): pip install torchao\n")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    from cosyllama.config import load_config
    from cosyllama.flow import Flow
    from cosyllama.timing import rounds
    from cosyllama.tools.bench_flow import FlowVariant, _inputs
    from cosyllama.tools.bench_setup import ensure_full_model, machine_info

    inductor_config.freezing = True  # weights become constants: inductor pre-packs them for its kernels
    model = Path(args.model_dir or ensure_full_model(print))
    config = load_config(model)
    flow = Flow.from_config(config, torch.device("cpu")).eval()
    cfm, dit = flow.decoder, flow.decoder.estimator
    inputs = _inputs(config, args.prompt_seconds, args.output_seconds, torch.Generator().manual_seed(0),
                     torch.device("cpu"))
    calibration = _inputs(config, args.prompt_seconds, args.output_seconds, torch.Generator().manual_seed(1),
                          torch.device("cpu"))
    frames = 2 * (inputs[0].shape[1] + inputs[1].shape[1])
    res: dict = {"machine": machine_info(args.threads), "frames": frames, "scope": args.scope, "setup": {}, "rows": {}}
    with torch.no_grad():
        flow.set_precision("fp32")
        ref = flow.inference(*inputs)
        bf16_dit = torch.compile(_Estimator(dit).eval())
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_dit(*_example(frames))
        res["setup"]["inductor_bf16_compile_s"] = round(time.perf_counter() - t0, 1)
        steps = cfm.n_timesteps
        runs: dict[str, torch.nn.Module | str] = {"bf16": "bf16", "int8-onednn+bf16": "int8-onednn+bf16",
                                                  "inductor-bf16": _Steps(dit, steps, bf16_dit, bf16_dit, 0, True)}
        for scheme in schemes:
            q, setup = quantized_dit(flow, scheme, args.scope, frames, calibration)
            res["setup"][scheme] = setup
            print(f"pt2e {scheme}: export + calibration {setup['export_calibrate_s']} s, "
                  f"compile {setup['compile_s']} s", flush=True)
            runs[f"pt2e-{scheme}"] = _Steps(dit, steps, q, bf16_dit, 0, True)
            runs[f"pt2e-{scheme}+2bf16"] = _Steps(dit, steps, q, bf16_dit, TAIL_STEPS, True)
        for name in rounds(list(runs), args.rounds):
            run = runs[name]
            if isinstance(run, str):
                cfm.estimator = dit
                FlowVariant.parse(run).apply(flow)
            else:
                flow.set_precision("fp32")
                cfm.estimator = run
            try:
                if name not in res["rows"]:
                    flow.inference(*inputs)  # warm, before its first timed call
                t0 = time.perf_counter()
                mel = flow.inference(*inputs)
                wall = time.perf_counter() - t0
            finally:
                cfm.estimator = dit
            err = (mel.float() - ref.float()).abs()
            row = res["rows"].setdefault(name, {"seconds_per_audio_second": [],
                                                "mel_error_mean": round(float(err.mean()), 4),
                                                "mel_error_max": round(float(err.max()), 4)})
            row["seconds_per_audio_second"].append(round(wall / args.output_seconds, 3))
        bf16 = min(res["rows"]["bf16"]["seconds_per_audio_second"])
        for name, row in res["rows"].items():
            best = min(row["seconds_per_audio_second"])
            print(f"{name:22s} {best:.3f} s/s ({bf16 / best:.2f}x bf16), mel vs fp32 {row['mel_error_mean']:.4f} / "
                  f"{row['mel_error_max']:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
