"""``cosyllama wyoming``: the Wyoming server for Home Assistant (see :mod:`cosyllama.server.wyoming`)."""

from __future__ import annotations

from ..defaults import WYOMING_URI
from .flags import add_connection_options, add_serving_options, add_wyoming_voice_option


def add_parser(sub) -> None:
    """The ``wyoming`` command's arguments (``sub``: the CLI's sub-parsers)."""
    w = sub.add_parser("wyoming", help="Wyoming protocol server (Home Assistant's voice pipeline), streaming")
    add_serving_options(w)
    w.add_argument("--uri", default=WYOMING_URI,
                   help=f"where to listen: tcp://HOST:PORT or unix://PATH (default {WYOMING_URI}; "
                        "tcp://0.0.0.0:10200 for Home Assistant on another machine)")
    add_connection_options(w)
    add_wyoming_voice_option(w)
    w.set_defaults(func=run)


def run(args) -> int:
    from ..server.startup import configure_logging
    from ..server.wyoming_server import run_wyoming  # the wyoming extra's hint before anything else
    from .options import serving_options

    configure_logging(args.log_level)
    run_wyoming(serving_options(args), args.uri)
    return 0
