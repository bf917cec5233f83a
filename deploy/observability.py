"""What deploy/render.py writes for monitoring: Prometheus's scrape config, the
prometheus-adapter rules that make WavePP's autoscaling gauges custom metrics, and the
Grafana dashboard. Every metric named here is one WavePP's server or router exports
(tests/unit/test_deploy.py checks each against a running server's and router's
``/metrics``).
"""

from __future__ import annotations

import json

SCRAPE_INTERVAL = "15s"

# The autoscaling signal (docs/fleet.md, "Autoscaling"): per pod, as prometheus-adapter
# serves it to a HorizontalPodAutoscaler under the same name.
#   name: (how the adapter folds a pod's series into one value, what it means)
AUTOSCALING_METRICS = {
    "wavepp_drain_seconds": ("max", "predicted seconds to finish the work waiting now"),
    "wavepp_engine_queue_oldest_seconds": ("max", "the oldest queued request's wait so far"),
    "wavepp_engine_tokens_waiting": ("sum", "queued prompt tokens + admitted uncached tokens"),
}


def prometheus_config() -> dict:
    """prometheus.yml: every pod of the recipe that says ``prometheus.io/scrape: "true"``
    (the pipelines' rank-0 pods, the router, the vLLM decoders), scraped on the port and
    path its annotations name, labelled with its namespace and pod (what
    prometheus-adapter maps to Kubernetes objects) and its component and pipeline."""
    meta = "__meta_kubernetes_pod_"
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [{
            "job_name": "wavepp",
            "kubernetes_sd_configs": [{"role": "pod"}],
            "relabel_configs": [
                {"source_labels": [meta + "label_app_kubernetes_io_part_of"],
                 "regex": "wavepp", "action": "keep"},
                {"source_labels": [meta + "annotation_prometheus_io_scrape"],
                 "regex": "true", "action": "keep"},
                {"source_labels": [meta + "annotation_prometheus_io_path"],
                 "regex": "(.+)", "target_label": "__metrics_path__"},
                {"source_labels": ["__address__", meta + "annotation_prometheus_io_port"],
                 "regex": r"([^:]+)(?::\d+)?;(\d+)", "replacement": "$1:$2",
                 "target_label": "__address__"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": [meta + "name"], "target_label": "pod"},
                {"source_labels": [meta + "label_app_kubernetes_io_component"],
                 "target_label": "component"},
                {"source_labels": [meta + "label_wavepp_pipeline"], "target_label": "pipeline"},
            ],
        }],
    }  # fmt: skip


def adapter_rules() -> dict:
    """prometheus-adapter's ``rules`` (its config.yaml): each autoscaling gauge as a pods
    custom metric of the same name."""
    rules = []
    for name, (fold, _) in AUTOSCALING_METRICS.items():
        rules.append({
            "seriesQuery": f'{name}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"},
                                        "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{name}$", "as": name},
            "metricsQuery": f"{fold}(<<.Series>>{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)",
        })  # fmt: skip
    return {"rules": rules}


def _quantile(q: float, histogram: str, by: str = "pod") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket[5m])))"


def _share(part: str, whole: str, by: str = "pod") -> str:
    return f"sum by ({by}) (rate({part}[5m])) / sum by ({by}) (rate({whole}[5m]))"


# (title, unit, what it shows, [(PromQL, legend)])
PANELS = [
    ("Stage utilization (busy / wall since start)", "percentunit",
     "each pipeline stage's busy time over its uptime",
     [("wavepp_engine_stages_utilization", "{{pod}} stage {{stage}}")]),
    ("Reused share of prompt tokens", "percentunit",
     "cached / prompt tokens of done requests, per pipeline and as the router counted them",
     [(_share("wavepp_cached_tokens_total", "wavepp_prompt_tokens_total"), "{{pod}}"),
      (_share("wavepp_route_cached_tokens_total", "wavepp_route_prompt_tokens_total", "policy"),
       "fleet ({{policy}})"),
      (_share("wavepp_route_predicted_cached_tokens_total", "wavepp_route_prompt_tokens_total",
              "policy"), "fleet predicted ({{policy}})")]),
    ("Prompt tokens per second", "short", "done per second over the last 30 s",
     [("wavepp_throughput_tokens_per_second", "{{pod}} prompt"),
      ("wavepp_computed_tokens_per_second", "{{pod}} computed (uncached)")]),
    ("Queue wait", "s", "submission to admission of done requests (p50, p90), and the "
     "oldest queued request's wait so far",
     [(_quantile(0.5, "wavepp_queue_seconds"), "{{pod}} p50"),
      (_quantile(0.9, "wavepp_queue_seconds"), "{{pod}} p90"),
      ("wavepp_engine_queue_oldest_seconds", "{{pod}} oldest queued")]),
    ("Tokens waiting", "short", "queued prompt tokens and admitted uncached tokens no wave "
     "has carried yet", [("wavepp_engine_tokens_waiting", "{{pod}} {{state}}")]),
    ("Predicted time to drain", "s", "the waiting work at the recent rates "
     "(absent while work waits and nothing was done lately)",
     [("wavepp_drain_seconds", "{{pod}}")]),
    ("Time to result", "s", "submission to result of done requests",
     [(_quantile(0.5, "wavepp_time_to_result_seconds"), "{{pod}} p50"),
      (_quantile(0.99, "wavepp_time_to_result_seconds"), "{{pod}} p99")]),
    ("Handoff bytes per second", "Bps", "prompt caches handed to decoders",
     [("sum by (pod) (rate(wavepp_handoff_bytes_total[5m]))", "{{pod}}")]),
    ("Handoff latency", "s", "a request's last chunk to the decoder's acknowledgement, the "
     "slowest stage's", [(_quantile(0.5, "wavepp_handoff_seconds"), "{{pod}} p50"),
                         (_quantile(0.9, "wavepp_handoff_seconds"), "{{pod}} p90")]),
    ("SLO attainment", "percentunit", "requests done by their deadline / requests with one",
     [("wavepp_engine_slo_attainment", "{{pod}}"),
      ("wavepp_route_slo_attainment", "fleet (router)")]),
    ("Requests routed per replica", "reqps", "the router's sends, retries by reason",
     [("sum by (replica) (rate(wavepp_route_requests_total[5m]))", "{{replica}}"),
      ("sum by (reason) (rate(wavepp_route_retries_total[5m]))", "retry: {{reason}}")]),
    ("Replicas up and pipelines healthy", "short", "the router's replicas up; 1 per pipeline "
     "whose ranks all answer heartbeats",
     [("wavepp_route_replicas_up", "replicas up"), ("wavepp_up", "{{pod}} up")]),
]  # fmt: skip


def dashboard() -> dict:
    """A Grafana dashboard (JSON model) of :data:`PANELS`, two panels a row, over a
    Prometheus data source chosen when it is imported."""
    panels = []
    for i, (title, unit, description, queries) in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "description": description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (expr, legend) in enumerate(queries)],
        })  # fmt: skip
    return {
        "title": "WavePP fleet",
        "uid": "wavepp-fleet",
        "tags": ["wavepp"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus",
                                 "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }  # fmt: skip


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
