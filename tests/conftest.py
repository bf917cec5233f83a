"""Suite-wide markers."""

from __future__ import annotations

from pathlib import Path

import pytest

# Test modules whose outcome depends on a third-party release's behaviour, not only on
# WavePP's code: transformers (parity, the handoff's caches, the decode worker, chat
# templates), tokenizers, jinja2 (chat templates), msgspec (wire codecs), starlette /
# uvicorn / httpx (server, router), pyzmq (KV events), vLLM (interop).
# `.ci/drift -m deps` runs just these against the newest releases.
DEPS = {
    "parity": None,  # the whole folder: transformers
    "unit": {
        "test_codec.py", "test_handoff_wire.py", "test_kv_events.py", "test_serve_app.py",
        "test_serve_drain.py", "test_serve_protocol.py", "test_serve_prom.py",
        "test_route_proxy.py", "test_dependencies.py",
        "test_serve_chat.py", "test_serve_pd.py", "test_route_pd.py", "test_kv_events_auth.py",
    },
    "property": {"test_codec_fuzz.py", "test_kv_events_codec.py", "test_pull_codec_fuzz.py"},
    "integration": {
        "test_serve.py", "test_serve_decode.py", "test_decode_worker.py", "test_serve_pd.py",
        "test_kv_events_serve.py", "test_kv_events_vllm.py",
        "test_vllm_connector.py", "test_vllm_pd.py", "test_serve_decode_faults.py",
        "test_serve_abuse.py",
    },
}  # fmt: skip


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "deps: exercises a third-party release's behaviour (.ci/drift -m deps)"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        folder = DEPS.get(path.parent.name, ())
        if folder is None or path.name in folder:
            item.add_marker(pytest.mark.deps)
