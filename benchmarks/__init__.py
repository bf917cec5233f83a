"""The experiments behind ``docs/benchmarks.md``, run from the repository's root (they are
not part of the installed package; each imports ``wavepp``):

- ``python -m benchmarks``: the (workload x concurrency x rung) matrix (``matrix.py``);
- ``python -m benchmarks.plot``: its pictures;
- ``python -m benchmarks.probe``: the state core at 200K-token scale;
- ``python -m benchmarks.torch_exec``: the torch executor against transformers, PP2;
- the others (``admission``, ``fleet``, ``gpu``, ``handoff``, ``kernels``, ``scaling``,
  ``short_waves``, ``soak``, ``tp``, ``tp_vs_pp``, ``validate``, ``vllm_compare``) each
  say what they measure in their docstring and ``--help``.

The package keeps the load generator (``python -m wavepp.bench.load``) and the
simulator's calibration (``python -m wavepp.sim.calibrate``).
"""
