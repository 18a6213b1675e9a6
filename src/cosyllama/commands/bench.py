"""``cosyllama bench``: LLM, flow, vocoder and pipeline speed side by side (see :mod:`cosyllama.tools.bench`)."""

from __future__ import annotations

from ..defaults import AUTO_CPU_SHARE_MIN
from ..progress import to_stderr
from .flags import add_threads_option


def add_parser(sub) -> None:
    """The ``bench`` command's arguments (``sub``: the CLI's sub-parsers)."""
    b = sub.add_parser("bench", help="measure LLM, flow, vocoder and pipeline speed side by side")
    b.add_argument("--model-dir", help="model directory (default: a cached full-size random model)")
    b.add_argument("--json", help="also write the results as JSON")
    b.add_argument("--parts", default="llm,flow,vocoder,pipeline",
                   help="comma list of parts to run: llm, flow, vocoder, pipeline, and the opt-in flow-batch "
                        "(N concurrent flows one after another vs one batch) and auto (time --precision auto's "
                        "flow candidates again, whatever is cached, show the new verdict beside the cached one, "
                        "and cache it in its place unless the machine was busy meanwhile: the process got under "
                        f"{AUTO_CPU_SHARE_MIN * 100:.0f}%% of the CPU its threads asked for)")
    b.add_argument("--repeat", type=int, default=1,
                   help="runs per configuration, median reported; the flow, vocoder and pipeline rows take "
                        "turns round by round (A B C, C B A, ...) so their ratios are side by side")
    b.add_argument("--llm-types", default=None, metavar="T,T",
                   help="GGUF types of the llama.cpp LLM rows (default: F16,Q8_0,Q4_K_M,Q4_0)")
    add_threads_option(b)
    b.add_argument("--prompt-seconds", type=float, default=3.0)
    b.add_argument("--output-seconds", type=float, default=10.0)
    b.add_argument("--device", default="cpu",
                   help="cpu or cuda: where the torch LLM, the flow and the vocoder run (default cpu); llama.cpp "
                        "rows use the GPU only if llama-cpp-python was built with GPU support")
    b.add_argument("--flow-precisions", default=None,
                   help="comma list of flow precisions to time (fp32 first: the others' fidelity is measured "
                        "against it; default fp32,bf16,int8 on the CPU, fp32,bf16 on a GPU); the pipeline's "
                        "rows take fp32 and auto. Research variants: fp32-autocast, bf16-res16, "
                        "<precision>-steps<N>, <variant>-torch-attention (see cosyllama.tools.bench_flow)")
    b.add_argument("--vocoder-precisions", default=None,
                   help="comma list of vocoder variants: fp32, bf16, and fp32-ref / bf16-ref (the reference "
                        "module path); default fp32,bf16")
    b.add_argument("--profile", action="store_true",
                   help="also split one flow and one vocoder call per variant by op kind (gemm, attention, "
                        "conv, ...; torch.profiler)")
    b.add_argument("--stream", action="store_true",
                   help="also time one streaming synthesis per flow variant (fp32 vocoder): first chunk, flow "
                        "calls, all; with the flow stream cache and recomputing every chunk")
    b.add_argument("--batch-sizes", default=None, metavar="N,N",
                   help="request counts of the flow-batch part (default 1,2,4,8,16)")
    b.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import fields

    from ..tools.bench import BenchOptions, run_bench

    options = BenchOptions(**{f.name: getattr(args, f.name) for f in fields(BenchOptions)})
    return run_bench(options, progress=to_stderr)
