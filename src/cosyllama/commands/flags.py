"""The flags several commands share, each defined once, their choices from the one vocabulary in
:mod:`cosyllama.defaults` (the load options' flags are read back by
:func:`cosyllama.commands.options.load_options`)."""

from __future__ import annotations

import argparse

from ..defaults import (
    FIRST_CHUNK_RANGE,
    INTERLEAVE_MODES,
    LANGUAGES,
    LLM_PRECISION,
    LLM_PRECISIONS,
    LLM_WEIGHTS,
    LOG_LEVEL,
    LOG_LEVELS,
    MAX_QUEUE,
    MAX_RETRIES,
    PRECISION,
    PRECISIONS,
    PREFILL_CHUNK,
    RETRIES,
    SERVE_PARALLEL,
    SPEED_RANGE,
)

# --precision's choices: defaults.PRECISIONS with auto (the default) first, as --help lists them
PRECISION_CHOICES = (PRECISION, *(p for p in PRECISIONS if p != PRECISION))


def add_llm_weights_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm-weights", default=LLM_WEIGHTS, metavar="FILE",
                   help=f"LLM checkpoint in the model directory (default {LLM_WEIGHTS}; the official directory "
                        "also ships the RL-tuned llm.rl.pt); a GGUF must be converted from the same file")


def add_precision_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--precision", choices=PRECISION_CHOICES, default=PRECISION, help=help)


def add_gpu_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-gpu-layers", type=int, default=None, metavar="N",
                   help="llama.cpp layers on the GPU (default: all of them with --device cuda, else 0)")
    p.add_argument("--llm-precision", choices=LLM_PRECISIONS, default=LLM_PRECISION,
                   help=f"torch LLM weights and KV cache (default {LLM_PRECISION}, the parity mode; bf16/fp16 "
                        "for a GPU)")


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """``--max-input-chars`` ... ``--max-session-chars``: the per-request bounds of the server."""
    from dataclasses import fields

    from ..limits import LIMIT_HELP, RequestLimits, limit_flag

    g = p.add_argument_group("per-request limits (a request over one is refused naming it: 413 over HTTP, "
                             "an error message over the WebSocket, an error event over Wyoming)")
    for f in fields(RequestLimits):
        g.add_argument(limit_flag(f.name), type=int, default=f.default, metavar="N",
                       help=f"{LIMIT_HELP[f.name]} (default {f.default})")


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """``--header-timeout`` ... ``--idle-timeout``: what a client may hold open (``serve`` and ``wyoming``)."""
    from dataclasses import fields

    from ..server.conn import CONNECTION_HELP, ConnectionLimits

    g = p.add_argument_group("connections (a slow, stalled or idle client is closed: HTTP answers 408 or 503, "
                             "Wyoming an error event; to Wyoming an event is a request's headers, and it has no body)")
    for f in fields(ConnectionLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       metavar="N" if f.name == "max_connections" else "S",
                       help=f"{CONNECTION_HELP[f.name]} (default {f.default:g})")


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def add_retries_option(p: argparse.ArgumentParser, served: bool = False) -> None:
    """``--retries N``: takes made again when one loops or runs away (``synth``; ``serve`` and ``wyoming``: the
    default of requests that give none)."""
    p.add_argument("--retries", type=int, default=RETRIES, metavar="N",
                   help=("requests that give no retries: " if served else "")
                   + f"make a text segment again with the next seed when its speech tokens loop or run to the "
                     f"length limit, at most N times (0-{MAX_RETRIES}; 0: only report it; default {RETRIES}; "
                     "docs/retries.md)")


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
    add_request_default_options(v)
    add_retries_option(v, served=True)
    v.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prompt positions prefilled between two decode steps of the other requests, so a long "
                        f"prompt does not stall them (default {PREFILL_CHUNK})")
    v.add_argument("--interleave", choices=("auto", *INTERLEAVE_MODES), default="auto",
                   help="pause LLM decoding while flow and vocoder work runs, so the stages take turns on the cores "
                        "instead of sharing them: never (off), for a stream's first chunk (first) or always (all); "
                        "auto: first where the LLM's and PyTorch's threads together outnumber the cores, else off "
                        "(the log says which)")
    v.add_argument("--voices", metavar="DIR|FILE",
                   help="DIR: keep voices there, one file each (made if missing; registrations and deletions "
                        "survive restarts and are seen by every server sharing DIR), and serve its voice folders "
                        "NAME/ref.wav (+ ref.txt transcript or instruct.txt); FILE: a voice file "
                        "(VoiceStore.save) served read-only; default: voices in memory only")
    v.add_argument("--lexicon", metavar="FILE",
                   help="a pronunciation lexicon (word<TAB>tokens lines, or a .json object; docs/pronunciation.md) "
                        "every request speaks, over HTTP, WebSocket and Wyoming; a voice folder's lexicon.txt and "
                        "a request's lexicon field add to it, their entries winning; checked before the model "
                        "loads")
    v.add_argument("--stream-cache-mb", type=float, default=None,
                   help="bound of each streaming request's flow K/V cache in MiB (default 2048 at bf16, "
                        "off at fp32; 0 = off)")
    add_loudness_option(v, "the loudness target (LUFS, ITU-R BS.1770, e.g. -16) of every request that gives none "
                           "(HTTP's field loudness; Wyoming requests, which carry none, all get it): one gain per "
                           "request, never past a -1 dBFS true peak (docs/loudness.md; needs the loudness extra); "
                           "default: off")
    v.add_argument("--prompt-cache-mb", type=float, default=None,
                   help="bound of the flow blocks shared between requests of one voice in MiB "
                        "(default 512 when the streaming cache is on; 0 = off)")
    v.add_argument("--log-level", choices=LOG_LEVELS, default=LOG_LEVEL,
                   help=f"the least severe log lines written to stderr (default {LOG_LEVEL}: the start, each "
                        "refusal, each client closed for a timeout and the stop, one line each; warning: only what "
                        "needs a look)")


def add_request_default_options(p: argparse.ArgumentParser) -> None:
    """``--seed``, ``--greedy``, ``--speed``: what every request of ``serve`` and ``wyoming`` starts from
    (:attr:`~cosyllama.server.options.ServingOptions.defaults`); an HTTP or WebSocket request that gives the field
    keeps its own, a Wyoming request (which carries none of them) always takes the server's."""
    g = p.add_argument_group("what every request starts from (HTTP and WebSocket requests that give the field keep "
                             "theirs; Wyoming requests, which carry none, take these)")
    g.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed of sampling, 0 to 2**31-1: the same text in the same voice sounds the same every time "
                        "(sentence k of a stream, segment k of a text: N + k); default: a fresh seed per request")
    g.add_argument("--greedy", action="store_true",
                   help="argmax decoding instead of sampling (deterministic, flatter; default: sampling)")
    g.add_argument("--speed", type=float, default=1.0, metavar="X",
                   help=f"speaking-rate factor, {SPEED_RANGE[0]}-{SPEED_RANGE[1]} (default 1.0); other than 1, each "
                        "sentence is synthesized whole before its audio is sent (its first audio comes later)")
    g.add_argument("--first-chunk-tokens", type=int, default=None, metavar="N",
                   help=f"streams only, outside the reference's schedule: each segment's first chunk covers N speech "
                        f"tokens ({FIRST_CHUNK_RANGE[0]}-{FIRST_CHUNK_RANGE[1]}) instead of 25 or more, so the first "
                        "audio comes sooner (docs/streaming.md, 'Low-latency first chunk'); default: the reference's")


def add_loudness_option(p: argparse.ArgumentParser, help: str) -> None:
    """``--loudness LUFS`` (:attr:`~cosyllama.request.SynthesisOptions.loudness`; checked with the request)."""
    p.add_argument("--loudness", type=float, default=None, metavar="LUFS", help=help)


def add_wyoming_voice_option(p: argparse.ArgumentParser, http: bool = False) -> None:
    """``--default-voice``; ``http``: the flag also serves the HTTP API's OpenAI voice names (``serve``)."""
    also = (" HTTP: what a request for one of OpenAI's voice names (alloy, ash, ..., verse) that is not registered "
            "speaks with (default: none, such a request gets 404).") if http else ""
    p.add_argument("--default-voice", metavar="ID",
                   help="Wyoming: the registered voice a request that names none (or names 'default') speaks "
                        "with (default: the first registered voice in alphabetical order)." + also)
    p.add_argument("--language", action="append", metavar="CODE",
                   help="Wyoming: a language describe lists for every voice (give it again for more; the first is "
                        "listed first); Home Assistant offers the voices for these, and a request for another is "
                        f"refused (default: all CosyVoice3 speaks: {', '.join(LANGUAGES)})")

