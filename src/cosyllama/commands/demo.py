"""``cosyllama demo``: the no-weights demo (see :mod:`cosyllama.tools.demo`)."""

from __future__ import annotations

from ..progress import to_stderr
from .flags import add_threads_option


def add_parser(sub) -> None:
    """The ``demo`` command's arguments (``sub``: the CLI's sub-parsers)."""
    d = sub.add_parser("demo", help="no-weights demo: synthesize with both backends on a full-size random model")
    add_threads_option(d)
    d.add_argument("--seconds", type=float, default=10.0, help="at most this much audio per backend (default 10)")
    d.add_argument("--out-dir", help="where to write the demo WAVs (default: the cache directory)")
    d.set_defaults(func=run)


def run(args) -> int:
    from ..options import LoadOptions, OptionError
    from ..tools.demo import run_demo

    try:  # --threads, checked before the model is made or loaded
        LoadOptions(".", threads=args.threads)
    except OptionError as e:
        raise e.as_flag() from None
    return run_demo(threads=args.threads, seconds=args.seconds, out_dir=args.out_dir, progress=to_stderr)
