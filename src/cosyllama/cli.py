"""``cosyllama`` command line: parse, call the Python API, write files, map errors to exit codes.

Exit codes: 0 success; 2 bad arguments or bad input (one line on stderr naming the problem, never a
traceback); 1 an unexpected internal failure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .defaults import (
    API_KEY_ENV,
    LLM_CHOICES,
    LLM_PRECISION,
    LLM_PRECISIONS,
    LLM_WEIGHTS,
    MAX_QUEUE,
    MAX_VOICES,
    PRECISION,
    PREFILL_CHUNK,
    SERVE_PARALLEL,
    SPEED_RANGE,
    WYOMING_URI,
)
from .errors import CosyllamaError
from .progress import counting_progress
from .progress import to_stderr as _progress

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# ----------------------------------------------------------------------------------------------
# sub-commands


def cmd_convert(args) -> int:
    from .llm.gguf import convert

    out = convert(args.model_dir, args.out, layout=args.layout, type=args.type, force=args.force,
                  progress=counting_progress(), llm_weights=args.llm_weights)
    print(f"wrote {out}")
    return 0


def cmd_synth(args) -> int:
    from .synth import run_synth

    return run_synth(args, progress=_progress)


def cmd_make_model(args) -> int:
    from .tools.synthetic import make_model

    make_model(args.dir, size=args.size, seed=args.seed, force=args.force, progress=_progress)
    print(f"wrote a random-weight {args.size} model to {args.dir}")
    return 0


def cmd_bench(args) -> int:
    from .tools.bench import run_bench

    return run_bench(args, progress=_progress)


def cmd_demo(args) -> int:
    from .tools.demo import run_demo

    return run_demo(args, progress=_progress)


def cmd_batch(args) -> int:
    from .batch.command import run_batch

    return run_batch(args)


def cmd_wyoming(args) -> int:
    from .heap import bound_onednn_cache

    bound_onednn_cache()  # before torch computes anything (see cosyllama.heap)
    from .server.wyoming import run_wyoming

    run_wyoming(args)
    return 0


def cmd_serve(args) -> int:
    from .heap import bound_onednn_cache

    bound_onednn_cache()  # before torch computes anything (see cosyllama.heap)
    from .server.app import serve

    serve(args)
    return 0


# ----------------------------------------------------------------------------------------------
# options several sub-commands share (each defined once)


def add_llm_weights_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm-weights", default=LLM_WEIGHTS, metavar="FILE",
                   help=f"LLM checkpoint in the model directory (default {LLM_WEIGHTS}; the official directory "
                        "also ships the RL-tuned llm.rl.pt); a GGUF must be converted from the same file")


def add_precision_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "int8"], default=PRECISION, help=help)


def add_gpu_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-gpu-layers", type=int, default=None, metavar="N",
                   help="llama.cpp layers on the GPU (default: all of them with --device cuda, else 0)")
    p.add_argument("--llm-precision", choices=LLM_PRECISIONS, default=LLM_PRECISION,
                   help=f"torch LLM weights and KV cache (default {LLM_PRECISION}, the parity mode; bf16/fp16 "
                        "for a GPU)")


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """``--max-input-chars`` ... ``--max-seq-tokens``: the per-request bounds of the server."""
    from dataclasses import fields

    from .limits import LIMIT_HELP, RequestLimits, limit_flag

    g = p.add_argument_group("per-request limits (a request over one is refused naming it: 413 over HTTP, "
                             "an error event over Wyoming)")
    for f in fields(RequestLimits):
        g.add_argument(limit_flag(f.name), type=int, default=f.default, metavar="N",
                       help=f"{LIMIT_HELP[f.name]} (default {f.default})")


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """``--header-timeout``, ``--body-timeout``, ``--max-connections``: what a client may hold open."""
    from dataclasses import fields

    from .server.conn import CONNECTION_HELP, ConnectionLimits

    g = p.add_argument_group("connections (slow or idle clients are closed, 408)")
    for f in fields(ConnectionLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       metavar="N" if f.name == "max_connections" else "S",
                       help=f"{CONNECTION_HELP[f.name]} (default {f.default:g})")


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def add_serving_options(v: argparse.ArgumentParser) -> None:
    """The model, precision, concurrency, limits and voices options of ``serve`` and ``wyoming``."""
    v.add_argument("--model-dir", required=True)
    v.add_argument("--gguf", help="serve the LLM from this GGUF through llama.cpp")
    v.add_argument("--parallel", type=int, default=SERVE_PARALLEL,
                   help=f"llama.cpp sequences decoded together in one batch (default {SERVE_PARALLEL})")
    add_threads_option(v)
    v.add_argument("--device", default="cpu", help="cpu or cuda for the flow and vocoder (and the torch LLM)")
    add_gpu_options(v)
    add_precision_option(v, f"flow compute precision (default {PRECISION})")
    add_llm_weights_option(v)
    v.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help=f"requests that may wait; more are refused as busy (default {MAX_QUEUE})")
    add_limit_options(v)
    v.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prompt positions prefilled between two decode steps of the other requests, so a long "
                        f"prompt does not stall them (default {PREFILL_CHUNK})")
    v.add_argument("--voices", metavar="DIR|FILE",
                   help="DIR: keep voices there, one file each (made if missing; registrations and deletions "
                        "survive restarts and are seen by every server sharing DIR); FILE: a voice file "
                        "(VoiceStore.save) served read-only; default: voices in memory only")
    v.add_argument("--stream-cache-mb", type=float, default=None,
                   help="bound of each streaming request's flow K/V cache in MiB (default 2048 at bf16, "
                        "off at fp32; 0 = off)")
    v.add_argument("--prompt-cache-mb", type=float, default=None,
                   help="bound of the flow blocks shared between requests of one voice in MiB "
                        "(default 512 when the streaming cache is on; 0 = off)")


def add_wyoming_voice_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--default-voice", metavar="ID",
                   help="Wyoming: the registered voice a request that names none (or names 'default') speaks "
                        "with (default: the first registered voice in alphabetical order)")


# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cosyllama", description="CosyVoice3 text-to-speech with the LLM on llama.cpp or PyTorch")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("synth", help="synthesize speech to a WAV file")
    s.add_argument("--model-dir", required=True, help="official CosyVoice3 model directory")
    s.add_argument("--text", required=True, help="text to speak")
    s.add_argument("--out", required=True, help="output .wav (24 kHz mono)")
    s.add_argument("--out-format", choices=["pcm16", "float"], default="pcm16",
                   help="16-bit PCM (default) or 32-bit float WAV")
    s.add_argument("--prompt-wav", help="prompt audio (wav/flac/ogg/mp3), up to 30 s")
    s.add_argument("--prompt-text", help="transcript of the prompt audio")
    s.add_argument("--instruct", help="instruction for instruct mode (e.g. 'Speak slowly.')")
    s.add_argument("--mode", choices=["zero-shot", "cross-lingual", "instruct"], default=None,
                   help="default: instruct if --instruct, zero-shot if --prompt-text, else cross-lingual")
    s.add_argument("--llm", choices=LLM_CHOICES, default=None,
                   help="LLM backend (default: llamacpp when --gguf is given, else torch)")
    s.add_argument("--gguf", help="GGUF file for --llm llamacpp")
    s.add_argument("--stream", action="store_true", help="synthesize in streaming chunks")
    s.add_argument("--greedy", action="store_true", help="argmax decoding (deterministic)")
    s.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    s.add_argument("--speed", type=float, default=1.0,
                   help=f"speaking-rate factor, {SPEED_RANGE[0]}-{SPEED_RANGE[1]} (non-streaming)")
    s.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    add_gpu_options(s)
    add_threads_option(s)
    add_precision_option(s, "flow compute: auto = bf16 where the CPU/GPU has it natively, int8 on other x86 CPUs, "
                            "each kept only if a fidelity check on the loaded weights passes, else fp32 (the "
                            "reference)")
    add_llm_weights_option(s)
    s.add_argument("--tokens-out", help="write the speech tokens per text segment as JSON")
    s.set_defaults(func=cmd_synth)

    from .batch.command import add_parser as add_batch_parser

    add_batch_parser(sub)
    add_llm_weights_option(sub.choices["batch"])
    add_gpu_options(sub.choices["batch"])
    sub.choices["batch"].set_defaults(func=cmd_batch)

    c = sub.add_parser("convert", help="write the LLM as a GGUF file for llama.cpp")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--out", required=True, help="output .gguf file")
    c.add_argument("--layout", choices=["speech", "merged"], default="speech")
    c.add_argument("--type", default="Q8_0", help="F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, ... (default Q8_0)")
    c.add_argument("--force", action="store_true", help="overwrite an existing output file")
    add_llm_weights_option(c)
    c.set_defaults(func=cmd_convert)

    m = sub.add_parser("make-model", help="write a random-weight model directory in the official layout")
    m.add_argument("dir")
    m.add_argument("--size", choices=["tiny", "full"], default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true", help="overwrite an existing directory's files")
    m.set_defaults(func=cmd_make_model)

    b = sub.add_parser("bench", help="measure LLM, flow, vocoder and pipeline speed side by side")
    b.add_argument("--model-dir", help="model directory (default: a cached full-size random model)")
    b.add_argument("--json", help="also write the results as JSON")
    b.add_argument("--parts", default="llm,flow,vocoder,pipeline", help="comma list of parts to run")
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
                        "rows take fp32 and auto")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="no-weights demo: synthesize with both backends on a full-size random model")
    add_threads_option(d)
    d.add_argument("--seconds", type=float, default=10.0, help="at most this much audio per backend (default 10)")
    d.add_argument("--out-dir", help="where to write the demo WAVs (default: the cache directory)")
    d.set_defaults(func=cmd_demo)

    v = sub.add_parser("serve", help="HTTP server with an OpenAI-style /v1/audio/speech endpoint")
    add_serving_options(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    add_connection_options(v)
    v.add_argument("--max-voices", type=int, default=MAX_VOICES, metavar="N",
                   help=f"registered voices; registering a new id past it gets 409 (default {MAX_VOICES})")
    v.add_argument("--api-key", metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every request but GET /health (default: "
                        f"${API_KEY_ENV}, else no key; the variable keeps the key out of the process list)")
    v.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                   help="a browser origin (scheme://host[:port]) allowed to POST and DELETE, with CORS; "
                        "repeatable (default none: requests carrying an Origin header may only GET)")
    v.add_argument("--wyoming", metavar="URI",
                   help=f"also answer the Wyoming protocol (Home Assistant) at URI, e.g. {WYOMING_URI}, from the "
                        "same model, voices and request slots (needs the wyoming extra)")
    add_wyoming_voice_option(v)
    v.set_defaults(func=cmd_serve)

    w = sub.add_parser("wyoming", help="Wyoming protocol server (Home Assistant's voice pipeline), streaming")
    add_serving_options(w)
    w.add_argument("--uri", default=WYOMING_URI,
                   help=f"where to listen: tcp://HOST:PORT or unix://PATH (default {WYOMING_URI}; "
                        "tcp://0.0.0.0:10200 for Home Assistant on another machine)")
    add_wyoming_voice_option(w)
    w.set_defaults(func=cmd_wyoming)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CosyllamaError as e:
        print(f"cosyllama {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
