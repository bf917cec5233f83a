"""Benchmarks.

- ``python -m wavepp.bench``: the (workload x concurrency x rung) matrix (``matrix.py``);
- ``python -m wavepp.bench.plot``: its pictures;
- ``python -m wavepp.bench.probe``: the state core at 200K-token scale;
- ``python -m wavepp.bench.torch_exec``: the torch executor against transformers, PP2.
"""
