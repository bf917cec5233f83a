"""The kinds of run, one class each, chosen once per run (:func:`backend_for`)."""

from wavepp.config import RunConfig
from wavepp.launch.backends.base import Backend, sharing_refused
from wavepp.launch.backends.datasheet import DatasheetBackend
from wavepp.launch.backends.measured import MeasuredBackend
from wavepp.launch.backends.torch_backend import TorchBackend

# Asked in order: the first that runs a config is its backend.
BACKENDS: tuple[type[Backend], ...] = (TorchBackend, MeasuredBackend, DatasheetBackend)


def backend_for(c: RunConfig) -> Backend:
    """The backend of ``c``'s kind of run (reading a measured profile, checked)."""
    for kind in BACKENDS:
        if kind.runs(c):
            return kind(c)
    raise SystemExit(f"wavepp: no backend runs --executor {c.executor!r}")


__all__ = [
    "BACKENDS",
    "Backend",
    "DatasheetBackend",
    "MeasuredBackend",
    "TorchBackend",
    "backend_for",
    "sharing_refused",
]
