"""The connector's figures in vLLM's own ``/metrics`` and log (``docs/handoff.md``, the
connector's metrics), through vLLM's KV connector stats hooks (0.31 and 0.32 alike):
the worker's connector hands each engine step's observations (``wavepp.vllm.figures``)
to vLLM as a :class:`LoadStats` (``get_kv_connector_stats``); vLLM carries their
``data`` to its front end in the scheduler's stats, where it builds a
:class:`LoadStats` again (``build_kv_connector_stats``: the interval's log line) and
hands the data to :class:`LoadMetrics` (``build_prom_metrics``), which keeps these
series, each with vLLM's ``model_name`` and ``engine`` labels:

- ``vllm:wavepp_loaded_bytes_total`` (counter): bytes written into the paged cache;
- ``vllm:wavepp_received_bytes_total`` (counter): band bytes read off the wire;
- ``vllm:wavepp_loads_total`` (counter): loads that landed whole;
- ``vllm:wavepp_load_seconds`` (histogram): the worker starting a load to its last
  layer written;
- ``vllm:wavepp_layer_landed_seconds`` (histogram): the request's arrival at vLLM to
  each layer written;
- ``vllm:wavepp_load_gigabytes_per_second`` (histogram): per load, the bytes received
  over its time;
- ``vllm:wavepp_load_errors_total{reason}`` (counter): loads failed (vLLM recomputes or
  fails them, per ``kv_load_failure_policy``), by ``figures.REASONS``;
- ``vllm:wavepp_pull_refusals_total`` (counter): pulls a stage refused (an expired
  lease, an unknown request, another model, an unsigned pull);
- ``vllm:wavepp_bands_released_total`` (counter): bands released unread (vLLM's own
  prefix cache had the prompt).

Imports vLLM: loaded by ``wavepp.vllm.connector`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from wavepp.vllm import figures

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)  # fmt: skip
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass
class LoadStats(KVConnectorStats):
    """One interval's observations (``data``: ``figures``' dict of lists)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = figures.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        figures.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return figures.summary(self.data)

    def is_empty(self) -> bool:
        return figures.is_empty(self.data)


class LoadMetrics(KVConnectorPromMetrics):
    """The series above, one child per engine (and per reason for the errors)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = per_engine_labelvalues

        def counter(name: str, doc: str) -> dict:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return {i: metric.labels(*values) for i, values in engines.items()}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> dict:
            metric = self._histogram_cls(name=name, documentation=doc, buckets=list(buckets),
                                         labelnames=labelnames)  # fmt: skip
            return {i: metric.labels(*values) for i, values in engines.items()}

        self.loaded_bytes = counter("vllm:wavepp_loaded_bytes", "Bytes WavePPConnector "
                                    "wrote into the paged KV cache.")  # fmt: skip
        self.received_bytes = counter("vllm:wavepp_received_bytes", "Band bytes "
                                      "WavePPConnector read from WavePP's stages.")  # fmt: skip
        self.loads = counter("vllm:wavepp_loads", "Prompt cache loads from WavePP that "
                             "landed whole.")  # fmt: skip
        self.load_seconds = histogram(
            "vllm:wavepp_load_seconds", "Seconds from the worker starting a load from WavePP "
            "to its last layer written into the paged cache.", SECONDS_BUCKETS)  # fmt: skip
        self.layer_seconds = histogram(
            "vllm:wavepp_layer_landed_seconds", "Seconds from the request's arrival at vLLM "
            "to each layer loaded from WavePP written into the paged cache.",
            SECONDS_BUCKETS)  # fmt: skip
        self.gbps = histogram(
            "vllm:wavepp_load_gigabytes_per_second", "Per load from WavePP: band bytes "
            "received over the load's seconds, 1e9 bytes per second.", GBPS_BUCKETS)  # fmt: skip
        errors = self._counter_cls(name="vllm:wavepp_load_errors",
                                   documentation="Loads from WavePP that failed (vLLM "
                                   "recomputes or fails them, per kv_load_failure_policy), "
                                   "by reason.", labelnames=[*labelnames, "reason"])  # fmt: skip
        self.errors = {(i, reason): errors.labels(*values, reason)
                       for i, values in engines.items() for reason in figures.REASONS}  # fmt: skip
        self.refusals = counter("vllm:wavepp_pull_refusals", "Pulls a WavePP stage "
                                "refused (an expired lease, an unknown request, ...).")  # fmt: skip
        self.released = counter("vllm:wavepp_bands_released", "WavePP bands released "
                                "unread: vLLM's own prefix cache had the prompt.")  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        i = engine_idx
        for n in data.get("loaded_bytes", ()):
            self.loaded_bytes[i].inc(n)
        for n in data.get("received_bytes", ()):
            self.received_bytes[i].inc(n)
        for s in data.get("load_seconds", ()):
            self.loads[i].inc()
            self.load_seconds[i].observe(s)
        for s in data.get("layer_seconds", ()):
            self.layer_seconds[i].observe(s)
        for g in data.get("gigabytes_per_second", ()):
            self.gbps[i].observe(g)
        for reason in data.get("load_errors", ()):
            self.errors[(i, reason if reason in figures.REASONS else "error")].inc()
        for _ in data.get("refusals", ()):
            self.refusals[i].inc()
        for _ in data.get("released", ()):
            self.released[i].inc()
