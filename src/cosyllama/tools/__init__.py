"""Tools beside the engine: benchmarks (``bench`` and its flow/vocoder parts ``bench_flow``, on the
set-up they share, ``bench_setup``), random-weight model directories (``synthetic``) and the no-weights demo
(``demo``). Nothing in the engine imports from here."""
