"""The reference decode worker (``python -m wavepp.decode``): receives handoffs and
decodes from them with ``transformers`` on CPU — a reference for correctness, not speed.
See ``docs/handoff.md``."""
