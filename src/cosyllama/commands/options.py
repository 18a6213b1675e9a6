"""Parsed flags into typed options: the one place the commands read their argparse namespace for the
options below :mod:`cosyllama.commands` (the code there takes these, never the namespace). Errors name
the flags (:meth:`cosyllama.options.OptionError.as_flag`)."""

from __future__ import annotations

from dataclasses import fields, replace

from ..defaults import MAX_SEQ_TOKENS, SERVE_PARALLEL
from ..errors import InputError
from ..limits import RequestLimits
from ..options import LoadOptions, OptionError


def load_options(args, defaults: dict | None = None, **changes) -> LoadOptions:
    """The :class:`LoadOptions` of a command's parsed arguments: every field the command has a flag of
    (unset flags keep the defaults), the backend from ``--llm`` and ``--gguf`` (llama.cpp when a GGUF is
    given), the LLM context from ``--max-seq-tokens`` where the command has it (``serve``, ``wyoming``),
    then ``changes``; ``defaults``: values of the fields the command has no flag of."""
    given = {f.name: getattr(args, f.name) for f in fields(LoadOptions)
             if f.name not in ("llm", "limits", "max_seq_tokens") and getattr(args, f.name, None) is not None}
    llm = getattr(args, "llm", None)
    if llm == "llamacpp" and given.get("gguf") is None:  # a command always builds its backend from a GGUF
        raise InputError("--llm llamacpp needs --gguf FILE (make one with `cosyllama convert`)")
    given["llm"] = llm  # None: llama.cpp when a GGUF is given
    if hasattr(args, "max_seq_tokens"):  # the server's per-request limits size the LLM context
        given["max_seq_tokens"] = request_limits(args).seq_tokens
    try:
        return LoadOptions(**{**(defaults or {}), **given, **changes})
    except OptionError as e:
        raise e.as_flag() from None


def request_limits(args) -> RequestLimits:
    """``--max-input-chars`` ... ``--max-session-chars`` (absent flags: the defaults)."""
    given = {f.name: getattr(args, "max_" + f.name, None) for f in fields(RequestLimits)}
    return RequestLimits(**{k: v for k, v in given.items() if v is not None})


def connection_limits(args):
    """``--header-timeout`` ... ``--idle-timeout`` (absent flags: the defaults)."""
    from ..server.conn import ConnectionLimits

    given = {f.name: getattr(args, f.name, None) for f in fields(ConnectionLimits)}
    return ConnectionLimits(**{k: v for k, v in given.items() if v is not None})


def interleave_choice(mode: str) -> str | None:
    """``--interleave``: None for auto (the server decides from threads and cores), else the mode."""
    return None if mode == "auto" else mode


def serving_options(args):
    """The options ``serve`` and ``wyoming`` share (:class:`~cosyllama.server.startup.ServingOptions`),
    checked before the minutes of loading a model."""
    from ..request import RequestError, SynthesisOptions, check_options
    from ..server.options import ServingOptions

    loudness = getattr(args, "loudness", None)
    try:
        # what requests that give none get (--seed, --greedy, --speed, --loudness, --retries)
        defaults = SynthesisOptions(loudness=loudness, retries=args.retries, seed=args.seed, greedy=args.greedy,
                                    speed=args.speed, first_chunk_tokens=args.first_chunk_tokens)
        if defaults.first_chunk_tokens is not None and defaults.speed != 1.0:
            raise InputError("--first-chunk-tokens shapes streamed requests, and at a --speed other than 1 every "
                             "request is made whole: give one of them")
        check_options(replace(defaults, stream=defaults.first_chunk_tokens is not None))  # it shapes streams
    except RequestError as e:
        raise e.as_flag() from None
    if loudness is not None:
        from ..loudness import require

        require()  # the install hint before loading a model
    lexicon = None
    if getattr(args, "lexicon", None) is not None:
        from ..text.lexicon import Lexicon

        lexicon = Lexicon.load(args.lexicon)  # a bad file is one line before the model loads
    return ServingOptions(
        load=load_options(args, defaults={"parallel": SERVE_PARALLEL, "max_seq_tokens": MAX_SEQ_TOKENS}),
        limits=request_limits(args), prefill_chunk=args.prefill_chunk, interleave=interleave_choice(args.interleave),
        max_queue=args.max_queue, voices=args.voices, default_voice=args.default_voice,
        languages=tuple(args.language) if args.language else None, connection_limits=connection_limits(args),
        defaults=defaults, lexicon=lexicon)


def serve_options(args):
    """``cosyllama serve``'s options (:class:`~cosyllama.server.startup.ServeOptions`), checked: the API
    key and origins, the voice aliases and default voice, the Wyoming URI (and its extra)."""
    from ..server.options import ServeOptions
    from ..server.security import guard_options
    from ..server.voice_names import VoiceNames, parse_voice_aliases

    api_key, origins = guard_options(args.api_key, args.allow_origin)
    serving = serving_options(args)
    aliases = parse_voice_aliases(args.voice_alias)
    VoiceNames(aliases, serving.default_voice)  # checks the ids before loading
    if args.wyoming is not None:
        from ..server.wyoming_server import check_uri  # the wyoming extra, checked before loading

        check_uri(args.wyoming)
    return ServeOptions(serving, host=args.host, port=args.port, api_key=api_key, allow_origins=tuple(origins),
                        max_voices=args.max_voices, wyoming=args.wyoming, voice_aliases=aliases)
