"""Benchmarks: ``python -m bench [--quick] [NAME ...]`` runs every ``bench/*_bench.py``.

Each module is one benchmark with a ``main(argv) -> int`` that parses its own flags (at least
``--quick``, which shrinks sizes for CI smoke runs, and ``--out``), prints a table and writes
its results as JSON to ``bench/results/<name>.json`` unless told otherwise.
"""
