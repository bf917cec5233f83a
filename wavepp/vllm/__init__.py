"""vLLM decoding from WavePP's prefill: ``WavePPConnector``, the KV connector an unmodified
vLLM loads with ``--kv-transfer-config '{"kv_connector": "WavePPConnector",
"kv_connector_module_path": "wavepp.vllm", "kv_role": "kv_consumer"}'``
(``docs/handoff.md``, the connector).

Importing this package imports no vLLM: the class is loaded from
``wavepp.vllm.connector`` when first asked for (vLLM's ``getattr``), so WavePP and its
tests import ``wavepp.vllm.plan`` and ``wavepp.vllm.pulling`` without vLLM installed.
"""

from __future__ import annotations

__all__ = ["WavePPConnector"]


def __getattr__(name: str):
    if name == "WavePPConnector":
        from wavepp.vllm.connector import WavePPConnector

        return WavePPConnector
    raise AttributeError(f"module 'wavepp.vllm' has no attribute {name!r}")
