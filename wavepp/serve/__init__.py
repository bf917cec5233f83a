"""The HTTP prefill server on rank 0 (``torchrun ... -m wavepp.serve``).

- :func:`build_app`: the Starlette application over an engine (``wavepp.engine``);
- :func:`serve`: that app under uvicorn on rank 0's event loop, until the engine drains;
- :mod:`wavepp.serve.api`: request bodies in, result bodies out (pure);
- :mod:`wavepp.serve.protocol`: what the server asks of an engine (``ServedEngine``);
- :mod:`wavepp.serve.prom`: ``/metrics`` through ``prometheus_client``;
- ``python -m wavepp.serve.launch``: one node under a supervisor (SIGTERM drains, exit 0).
"""

from wavepp.serve.app import ServeOptions, build_app
from wavepp.serve.server import serve

__all__ = ["ServeOptions", "build_app", "serve"]
