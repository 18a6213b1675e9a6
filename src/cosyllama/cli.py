"""``cosyllama`` command line: parse, call the Python API, write files, map errors to exit codes.

Exit codes: 0 success; 2 bad arguments or bad input (one line on stderr naming the problem, never a
traceback); 1 an unexpected internal failure.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .errors import CosyllamaError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``cosyllama`` parser: each command module adds its sub-parser, whose ``func`` is its ``run``."""
    from .commands import align, batch, bench, convert, demo, lexicon, make_model, serve, synth, wyoming

    p = _Parser(prog="cosyllama", description="CosyVoice3 text-to-speech with the LLM on llama.cpp or PyTorch")
    p.add_argument("--version", action="version", version=f"cosyllama {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in (synth, align, lexicon, batch, convert, make_model, bench, demo, serve, wyoming):
        command.add_parser(sub)
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
