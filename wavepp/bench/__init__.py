"""Benchmarks. ``python -m wavepp.bench.probe`` measures the state core."""
