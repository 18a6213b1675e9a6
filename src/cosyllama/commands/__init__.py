"""The commands of ``cosyllama``: one module each, with ``add_parser(sub)`` and ``run(args)``. Light to
import (heavy imports happen in ``run``), so ``cosyllama --help`` loads nothing; :mod:`cosyllama.cli` only
wires them."""
