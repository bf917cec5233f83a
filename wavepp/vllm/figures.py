"""What the connector measures (``docs/handoff.md``, the connector's metrics), as plain
data: the observations of one engine step on vLLM's worker, carried to vLLM's front end
inside its scheduler stats and read there into Prometheus (``wavepp.vllm.stats``). The
data is a dict of lists — what vLLM sends between its processes as it is — and two
steps' data merge by concatenating each list. Pure: no vLLM, no torch.

The keys, each a list of one entry per event:

- ``load_seconds``: per load that landed, seconds from the worker starting it to its
  last layer written;
- ``layer_seconds``: per layer of a load that landed, seconds from the request's arrival
  at vLLM (its ``arrival_time``, wall clock) to that layer written;
- ``loaded_bytes``: per load that landed, bytes written into vLLM's paged cache (the
  keys and values of the loaded rows);
- ``received_bytes``: per load that landed, payload bytes read off the wire (every
  stage's band, whole);
- ``gigabytes_per_second``: per load that landed, ``received_bytes`` over
  ``load_seconds``, in 1e9 bytes per second;
- ``load_errors``: per load that failed, why (one of ``REASONS``);
- ``refusals``: per pull a stage refused, 1;
- ``released``: per band released unread (vLLM's own cache had the prompt), 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

KEYS = ("load_seconds", "layer_seconds", "loaded_bytes", "received_bytes",
        "gigabytes_per_second", "load_errors", "refusals", "released")  # fmt: skip
REASONS = (
    "params",  # kv_transfer_params malformed, hostile or not allowed
    "connect",  # a stage's band server could not be reached
    "refused",  # a stage refused the pull (an expired lease, an unknown request, ...)
    "auth",  # a band's signature did not verify
    "band",  # a band failed another check (the model, the prompt, its shapes)
    "broken",  # a band's connection closed, stalled or failed part way
    "timeout",  # the load was not complete within timeout_s
    "incomplete",  # the bands left a layer out
    "error",  # anything else (a bug): the load fails, vLLM's loop goes on
)

Data = dict[str, list]


def empty() -> Data:
    """No observations."""
    return {key: [] for key in KEYS}


def is_empty(data: Mapping[str, list]) -> bool:
    return not any(data.get(key) for key in KEYS)


def record_load(data: Data, seconds: float, layer_seconds: Iterable[float], loaded_bytes: int,
                received_bytes: int) -> None:  # fmt: skip
    """A load that landed: every layer written by ``seconds`` after it started;
    ``layer_seconds``: each layer's, from the request's arrival."""
    data["load_seconds"].append(seconds)
    data["layer_seconds"].extend(layer_seconds)
    data["loaded_bytes"].append(loaded_bytes)
    data["received_bytes"].append(received_bytes)
    data["gigabytes_per_second"].append(received_bytes / seconds / 1e9 if seconds > 0 else 0.0)


def record_error(data: Data, reason: str) -> None:
    """A load that failed, for ``reason`` (one of ``REASONS``; ValueError otherwise)."""
    if reason not in REASONS:
        raise ValueError(f"load error reason {reason!r} is not one of {list(REASONS)}")
    data["load_errors"].append(reason)


def merge(into: Data, other: Mapping[str, list]) -> Data:
    """``into`` with ``other``'s observations after its own (keys it lacks are made)."""
    for key in KEYS:
        into.setdefault(key, []).extend(other.get(key, ()))
    return into


def summary(data: Mapping[str, list]) -> dict[str, int | float]:
    """The few figures vLLM logs for an interval."""
    seconds = list(data.get("load_seconds", ()))
    received = sum(data.get("received_bytes", ()))
    return {
        "Loads": len(seconds),
        "Load errors": len(data.get("load_errors", ())),
        "Pull refusals": len(data.get("refusals", ())),
        "Bands released": len(data.get("released", ())),
        "MB loaded": round(sum(data.get("loaded_bytes", ())) / 2**20, 3),
        "Avg load time (ms)": round(sum(seconds) / len(seconds) * 1e3, 3) if seconds else 0,
        "Throughput (GB/s)": round(received / sum(seconds) / 1e9, 3) if sum(seconds) else 0,
    }
