"""``cosyllama serve``: the HTTP server (see :mod:`cosyllama.server.app`)."""

from __future__ import annotations

from ..defaults import API_KEY_ENV, MAX_VOICES, WYOMING_URI
from .flags import add_connection_options, add_serving_options, add_wyoming_voice_option


def add_parser(sub) -> None:
    """The ``serve`` command's arguments (``sub``: the CLI's sub-parsers)."""
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
    add_wyoming_voice_option(v, http=True)
    v.add_argument("--voice-alias", action="append", metavar="NAME=ID",
                   help="HTTP: a request for voice NAME speaks with the registered voice ID, e.g. alloy=anna for "
                        "clients that send only OpenAI's voice names; repeatable; wins over a voice registered as "
                        "NAME")
    v.set_defaults(func=run)


def run(args) -> int:
    from ..server.app import serve  # the server extra's hint before anything else
    from ..server.startup import configure_logging
    from .options import serve_options

    configure_logging(args.log_level)
    serve(serve_options(args), log_level=args.log_level)
    return 0
