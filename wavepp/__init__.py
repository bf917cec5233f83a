"""WavePP: a pipeline-parallel prefill runtime for long prompts that share prefixes."""

__version__ = "0.1.0"
