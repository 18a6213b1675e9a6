"""Tools beside the engine: benchmarks (``bench``), random-weight model directories (``synthetic``)
and the no-weights demo (``demo``). Nothing in the engine imports from here."""
