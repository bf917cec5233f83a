"""The load generator for a running server or router: ``python -m wavepp.bench.load``.

The experiments behind ``docs/benchmarks.md`` (the matrix, plots, probes, scaling,
calibration checks, comparisons) are in the repository's ``benchmarks/``, run from its
root as ``python -m benchmarks.<name>``; they are not part of the installed package.
"""
