"""``cosyllama convert``: the LLM as a GGUF file for llama.cpp (see :func:`cosyllama.llm.gguf.convert`)."""

from __future__ import annotations

from ..progress import counting_progress
from .flags import add_llm_weights_option


def add_parser(sub) -> None:
    """The ``convert`` command's arguments (``sub``: the CLI's sub-parsers)."""
    c = sub.add_parser("convert", help="write the LLM as a GGUF file for llama.cpp")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--out", required=True, help="output .gguf file")
    c.add_argument("--layout", choices=["speech", "merged"], default="speech")
    c.add_argument("--type", default="Q8_0", help="F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, ... (default Q8_0)")
    c.add_argument("--force", action="store_true", help="overwrite an existing output file")
    add_llm_weights_option(c)
    c.set_defaults(func=run)


def run(args) -> int:
    from ..llm.gguf import convert

    out = convert(args.model_dir, args.out, layout=args.layout, type=args.type, force=args.force,
                  progress=counting_progress(), llm_weights=args.llm_weights)
    print(f"wrote {out}")
    return 0
