"""``cosyllama make-model``: a random-weight model directory in the official layout (see
:mod:`cosyllama.tools.synthetic`)."""

from __future__ import annotations

from ..progress import to_stderr


def add_parser(sub) -> None:
    """The ``make-model`` command's arguments (``sub``: the CLI's sub-parsers)."""
    m = sub.add_parser("make-model", help="write a random-weight model directory in the official layout")
    m.add_argument("dir")
    m.add_argument("--size", choices=["tiny", "full"], default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true", help="overwrite an existing directory's files")
    m.set_defaults(func=run)


def run(args) -> int:
    from ..tools.synthetic import make_model

    make_model(args.dir, size=args.size, seed=args.seed, force=args.force, progress=to_stderr)
    print(f"wrote a random-weight {args.size} model to {args.dir}")
    return 0
