"""Render WavePP's Kubernetes recipe: N pipelines × nodes × processes, the router, the vLLM
decoders, the autoscaler, and the monitoring files.

    python deploy/render.py                        # the committed default, into deploy/k8s
    python deploy/render.py --nodes 1 --out deploy/k8s-autoscaled   # one node a pipeline, HPA
    python deploy/render.py --pipelines 4 --nodes 2 --procs-per-node 8 --out /tmp/k8s

Not part of the installed package: stdlib and PyYAML. What it writes (deploy/README.md):

- ``pipelines.yaml``: with ``--nodes`` K > 1, per pipeline a headless Service (the
  rendezvous's DNS), a leader StatefulSet (one pod: rank 0, which serves HTTP), a worker
  StatefulSet (K - 1 pods) and a Service selecting only the leader (HTTP, KV events);
  with K = 1, one StatefulSet of N pods, each a whole pipeline, behind one headless
  Service (each pod is a router replica by its DNS name; an HPA may scale it).
- ``router.yaml``, ``decoders.yaml``: Deployments and Services.
- ``hpa.yaml`` and ``prometheus-adapter.yaml`` (the adapter's rules), K = 1 only.
- ``deploy/monitoring/``: ``prometheus.yml`` and ``grafana-dashboard.json`` (the same
  for every shape).

Every pod of a pipeline runs the README's multi-node command: ``torchrun --nnodes K
--nproc-per-node P --rdzv-backend c10d --rdzv-endpoint LEADER:29400 --rdzv-id ID -m
wavepp.serve ...``. torch's c10d rendezvous numbers the nodes in the sorted order of
their addresses (``--local-addr``, here each pod's stable DNS name), so the leader's
name is chosen to sort first and rank 0 runs in the pod the HTTP Service selects
(:func:`_check_rank_zero`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    """deploy/NAME.py as a module (deploy/ is no package: nothing of it is installed)."""
    spec = importlib.util.spec_from_file_location(f"wavepp_deploy_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


observability = _sibling("observability")
HTTP_PORT = 8000  # the server's, the router's and vLLM's
KV_EVENTS_PORT = 5557  # ZMQ PUB; the replay socket is the next port
RDZV_PORT = 29400  # the c10d rendezvous store, on the leader
PART_OF = "wavepp"
CONNECTOR = {"kv_connector": "WavePPConnector", "kv_connector_module_path": "wavepp.vllm",
             "kv_role": "kv_consumer"}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python deploy/render.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "k8s", help="directory [deploy/k8s]")
    p.add_argument("--monitoring-out", type=Path, default=HERE / "monitoring",
                   help="directory of prometheus.yml and the dashboard [deploy/monitoring]")
    p.add_argument("--name", default="wavepp", help="prefix of every object's name [wavepp]")
    p.add_argument("--pipelines", type=int, default=2, help="pipelines, N [2]")
    p.add_argument("--max-pipelines", type=int, default=None,
                   help="--nodes 1: the HPA's maximum, and the replicas the router lists [2 N]")
    p.add_argument("--nodes", type=int, default=2, help="nodes (pods) a pipeline spans, K [2]")
    p.add_argument("--procs-per-node", type=int, default=4,
                   help="ranks a pod runs, P (GPUs with --device cuda) [4]")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="[cuda]")
    p.add_argument("--dtype", default="bfloat16", help="[bfloat16]")
    p.add_argument("--model", default="/models/model",
                   help="a checkpoint directory (on --model-claim) or a built-in model "
                   "[/models/model]")
    p.add_argument("--model-claim", default="models",
                   help="PersistentVolumeClaim mounted read-only at /models ('' for none) [models]")
    p.add_argument("--image", default="wavepp:cuda", help="WavePP's image [wavepp:cuda]")
    p.add_argument("--vllm-image", default="wavepp-vllm:latest",
                   help="the vLLM decoder image (deploy/Dockerfile.vllm) [wavepp-vllm:latest]")
    p.add_argument("--decoders", type=int, default=1, help="vLLM decoder pods (0: none) [1]")
    p.add_argument("--decoder-gpus", type=int, default=1, help="GPUs per decoder pod [1]")
    p.add_argument("--route-policy", default="prefix", help="the router's --policy [prefix]")
    p.add_argument("--drain-timeout-s", type=float, default=25.0,
                   help="the server's and the router's --drain-timeout-s [25]")
    p.add_argument("--serve-option", action="append", default=[], metavar="OPTION",
                   help="one more option for wavepp.serve (repeatable), e.g. "
                   "--serve-option=--capacity-blocks=4096")
    return p  # fmt: skip


# -- pieces ---------------------------------------------------------------------------


def _labels(a, component: str, **more: str) -> dict:
    return {"app.kubernetes.io/name": a.name, "app.kubernetes.io/part-of": PART_OF,
            "app.kubernetes.io/component": component, **more}  # fmt: skip


def _scraped(port: int = HTTP_PORT) -> dict:
    """Pod annotations deploy/prometheus.yml keeps."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}  # fmt: skip


def _http_probes(startup_minutes: int, liveness_s: int) -> dict:
    """Probes on ``GET /health``. Before the server listens (model loading, the
    rendezvous) the port refuses connections: the startup probe allows that for
    ``startup_minutes``. Once up, /health answers 200, and 503 while the server drains
    (after SIGTERM) or after a fault: readiness fails at once; liveness only after
    ``liveness_s``, longer than a drain, so a draining pod is not restarted mid-drain."""
    get = {"path": "/health", "port": "http"}
    return {
        "startupProbe": {"httpGet": get, "periodSeconds": 10,
                         "failureThreshold": startup_minutes * 6},
        "readinessProbe": {"httpGet": get, "periodSeconds": 5, "failureThreshold": 1},
        "livenessProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": max(liveness_s // 10, 1)},
    }  # fmt: skip


def _volumes(a) -> tuple[list, list]:
    """(volumes, mounts): shared memory for the ranks, and the models' claim."""
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}]
    if a.model_claim:
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": a.model_claim, "readOnly": True}})  # fmt: skip
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
    return volumes, mounts


def _resources(a, gpus: int) -> dict:
    if a.device == "cuda":
        return {"limits": {"nvidia.com/gpu": gpus}}
    return {"requests": {"cpu": str(a.procs_per_node)}}


def _grace(a) -> int:
    """Seconds between SIGTERM and SIGKILL: the drain, the leak check and a margin."""
    return int(a.drain_timeout_s) + 35


def _shutdown(a) -> list[str]:
    """torchrun forwards SIGTERM to its ranks, which drain; it waits this long for them
    before SIGKILL (its default, 30 s, is too short for a longer --drain-timeout-s), and
    the pod's grace period outlasts it."""
    return ["--shutdown-timeout", str(int(a.drain_timeout_s) + 15)]


def serve_args(a) -> list[str]:
    """wavepp.serve's options (after torchrun's ``-m wavepp.serve``)."""
    args = ["--host", "0.0.0.0", "--port", str(HTTP_PORT),
            "--kv-events", f"tcp://*:{KV_EVENTS_PORT}", "--model", a.model,
            "--device", a.device, "--dtype", a.dtype,
            "--drain-timeout-s", f"{a.drain_timeout_s:g}"]  # fmt: skip
    return args + list(a.serve_option)


def _server_ports(leader: bool) -> list[dict]:
    if not leader:
        return []
    return [{"name": "http", "containerPort": HTTP_PORT},
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT},
            {"name": "kv-replay", "containerPort": KV_EVENTS_PORT + 1},
            {"name": "rdzv", "containerPort": RDZV_PORT}]  # fmt: skip


def _pipeline_pod(a, labels: dict, torchrun: list[str], leader: bool) -> dict:
    volumes, mounts = _volumes(a)
    container = {
        "name": "wavepp",
        "image": a.image,
        "command": ["torchrun"],
        "args": [*torchrun, "-m", "wavepp.serve", *serve_args(a)],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": _server_ports(leader),
        "resources": _resources(a, a.procs_per_node),
        "volumeMounts": mounts,
        **(_http_probes(30, 60) if leader else {}),
    }
    metadata = {"labels": labels, **({"annotations": _scraped()} if leader else {})}
    return {"metadata": metadata, "spec": {
        "terminationGracePeriodSeconds": _grace(a), "containers": [container],
        "volumes": volumes}}  # fmt: skip


def _service(name: str, labels: dict, selector: dict, ports: Iterable[tuple[str, int]],
             headless: bool = False, not_ready: bool = False) -> dict:  # fmt: skip
    """``not_ready``: the pods are reached before they are ready (a pipeline's: the
    rendezvous meets before any rank serves, and the router, the only client of a
    pipeline's HTTP Service, probes /health itself and must read a draining or failed
    server's 503, not find no endpoint)."""
    spec = {"selector": selector,
            "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports]}  # fmt: skip
    if headless:
        spec["clusterIP"] = "None"
    if not_ready:
        spec["publishNotReadyAddresses"] = True
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": labels}, "spec": spec}  # fmt: skip


def _statefulset(name: str, service: str, replicas: int, labels: dict, pod: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "labels": labels},
            "spec": {"serviceName": service, "replicas": replicas,
                     # every node of a pipeline at once: the rendezvous waits for all
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels}, "template": pod}}  # fmt: skip


SERVER_PORTS = (("http", HTTP_PORT), ("kv-events", KV_EVENTS_PORT),
                ("kv-replay", KV_EVENTS_PORT + 1))  # fmt: skip


# -- the pipelines ----------------------------------------------------------------------


def _check_rank_zero(leader: str, workers: list[str]) -> None:
    """c10d numbers nodes by sorted address: the leader's must sort first."""
    if workers and min([leader, *workers]) != leader:
        raise ValueError(f"the leader's address {leader!r} does not sort before its "
                         f"workers' ({min(workers)!r}): rank 0 would not be the leader")


def spanning_pipelines(a) -> tuple[list[dict], list[str]]:
    """K > 1: per pipeline, its headless Service, leader and worker StatefulSets and the
    leader's Service. Returns (objects, the router's replica URLs)."""
    objects, urls = [], []
    for k in range(a.pipelines):
        pipeline = f"{a.name}-p{k}"
        leader, workers = pipeline, f"{pipeline}-w"
        leader_addr = f"{leader}-0.{pipeline}"
        _check_rank_zero(leader_addr, [f"{workers}-{j}.{pipeline}" for j in range(a.nodes - 1)])
        torchrun = ["--nnodes", str(a.nodes), "--nproc-per-node", str(a.procs_per_node),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{leader_addr}:{RDZV_PORT}",
                    "--rdzv-id", pipeline, "--local-addr", f"$(POD_NAME).{pipeline}",
                    *_shutdown(a)]  # fmt: skip
        # The leader hosts the rendezvous's store: said outright, not inferred from DNS
        # (its own name may not resolve yet when it starts)
        hosts = {True: ["--rdzv-conf", "is_host=true"], False: ["--rdzv-conf", "is_host=false"]}
        group = _labels(a, "pipeline", **{"wavepp-pipeline": pipeline})
        lead = {**group, "wavepp-role": "leader"}
        work = {**group, "wavepp-role": "worker"}
        objects += [
            _service(pipeline, group, group, [("rdzv", RDZV_PORT)], headless=True,
                     not_ready=True),
            _statefulset(leader, pipeline, 1, lead,
                         _pipeline_pod(a, lead, torchrun + hosts[True], True)),
            _statefulset(workers, pipeline, a.nodes - 1, work,
                         _pipeline_pod(a, work, torchrun + hosts[False], False)),
            _service(f"{pipeline}-http", lead, lead, SERVER_PORTS, not_ready=True),
        ]
        urls.append(f"http://{pipeline}-http:{HTTP_PORT}")
    return objects, urls


def node_pipelines(a) -> tuple[list[dict], list[str]]:
    """K = 1: one StatefulSet whose pods are whole pipelines (``torchrun --standalone``),
    each reached at its own DNS name through a headless Service. The router lists
    ``--max-pipelines`` of them: those not running are never up."""
    labels = {**_labels(a, "pipeline"), "wavepp-role": "leader"}
    torchrun = ["--standalone", "--nproc-per-node", str(a.procs_per_node), *_shutdown(a)]
    objects = [
        _service(a.name, labels, labels, SERVER_PORTS, headless=True, not_ready=True),
        _statefulset(a.name, a.name, a.pipelines, labels, _pipeline_pod(a, labels, torchrun, True)),
    ]
    urls = [f"http://{a.name}-{k}.{a.name}:{HTTP_PORT}" for k in range(_max_pipelines(a))]
    return objects, urls


def _max_pipelines(a) -> int:
    return a.max_pipelines or 2 * a.pipelines


# -- the router, the decoders, the autoscaler -------------------------------------------


def route_args(a, replicas: list[str], decoders: list[str]) -> list[str]:
    args = ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--policy", a.route_policy,
            "--drain-timeout-s", f"{a.drain_timeout_s:g}"]  # fmt: skip
    for url in replicas:
        args += ["--replica", url]
    for url in decoders:  # the P/D issue's option (deploy/README.md)
        args += ["--decoder", url]
    return args


def router(a, replicas: list[str], decoders: list[str]) -> list[dict]:
    labels = _labels(a, "router")
    get = {"path": "/health", "port": "http"}
    container = {
        "name": "router",
        "image": a.image,
        "command": ["python", "-m", "wavepp.route"],
        "args": route_args(a, replicas, decoders),
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        # /health: 200 while a replica is up, 503 while none is (pipelines still
        # starting) or the router drains: readiness only. Liveness asks that the
        # process answers at all, so a router waiting for its replicas is not restarted.
        "readinessProbe": {"httpGet": get, "periodSeconds": 5, "failureThreshold": 1},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},
        "resources": {"requests": {"cpu": "2", "memory": "2Gi"}},
    }  # fmt: skip
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": f"{a.name}-router", "labels": labels},
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels,
                                                     "annotations": _scraped()},
                                        "spec": {"terminationGracePeriodSeconds": _grace(a),
                                                 "containers": [container]}}}}  # fmt: skip
    return [deployment, _service(f"{a.name}-router", labels, labels, [("http", HTTP_PORT)])]


def decoders(a) -> tuple[list[dict], list[str]]:
    """vLLM decoders taking prompt caches through WavePP's connector (kv_consumer)."""
    if not a.decoders:
        return [], []
    name, labels = f"{a.name}-decoder", _labels(a, "decoder")
    volumes, mounts = _volumes(a)
    container = {
        "name": "vllm",
        "image": a.vllm_image,
        "command": ["vllm", "serve", a.model],
        "args": ["--host", "0.0.0.0", "--port", str(HTTP_PORT),
                 "--kv-transfer-config", json.dumps(CONNECTOR, separators=(",", ":"))],
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "resources": {"limits": {"nvidia.com/gpu": a.decoder_gpus}},
        "volumeMounts": mounts,
        **_http_probes(30, 60),
    }  # fmt: skip
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": name, "labels": labels},
                  "spec": {"replicas": a.decoders, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels,
                                                     "annotations": _scraped()},
                                        "spec": {"containers": [container],
                                                 "volumes": volumes}}}}  # fmt: skip
    service = _service(name, labels, labels, [("http", HTTP_PORT)])
    return [deployment, service], [f"http://{name}:{HTTP_PORT}"]


# Per pod: scale out when the waiting work would take longer than this to drain, when a
# request has queued this long, or when this many tokens wait.
HPA_TARGETS = {"wavepp_drain_seconds": "10", "wavepp_engine_queue_oldest_seconds": "5",
               "wavepp_engine_tokens_waiting": "262144"}  # fmt: skip


def autoscaler(a) -> dict:
    """An autoscaling/v2 HPA over the pipelines' StatefulSet (K = 1), on the custom
    metrics prometheus-adapter serves (prometheus-adapter.yaml)."""
    metrics = [{"type": "Pods", "pods": {"metric": {"name": name},
                                         "target": {"type": "AverageValue",
                                                    "averageValue": value}}}
               for name, value in HPA_TARGETS.items()]  # fmt: skip
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": a.name, "labels": _labels(a, "pipeline")},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                        "name": a.name},
                     "minReplicas": a.pipelines, "maxReplicas": _max_pipelines(a),
                     "metrics": metrics,
                     "behavior": {
                         # a new pipeline takes minutes to load: add one at a time
                         "scaleUp": {"stabilizationWindowSeconds": 60, "policies": [
                             {"type": "Pods", "value": 1, "periodSeconds": 300}]},
                         # a removed pipeline drains, and its cache is lost: go slowly
                         "scaleDown": {"stabilizationWindowSeconds": 900, "policies": [
                             {"type": "Pods", "value": 1, "periodSeconds": 600}]}}}}  # fmt: skip


def adapter_config(a) -> dict:
    labels = _labels(a, "monitoring")
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{a.name}-prometheus-adapter", "labels": labels},
            "data": {"config.yaml": _dump_one(observability.adapter_rules())}}  # fmt: skip


# -- output -----------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Plain YAML: a value written twice is written out twice (no anchors)."""

    def ignore_aliases(self, data) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None  # an embedded file reads as one
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _string)


def _dump_one(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=100)  # fmt: skip


def _file(docs: list[dict], command: str) -> str:
    head = (f"# Rendered by {command}\n# Do not edit: change deploy/render.py and render "
            "again (tests/unit/test_deploy.py compares).\n")
    return head + "---\n".join(_dump_one(doc) for doc in docs)


def check(a) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SystemExit(f"render: {message}")

    need(a.pipelines >= 1, f"--pipelines must be ≥ 1, got {a.pipelines}")
    need(a.nodes >= 1, f"--nodes must be ≥ 1, got {a.nodes}")
    need(a.procs_per_node >= 1, f"--procs-per-node must be ≥ 1, got {a.procs_per_node}")
    need(a.decoders >= 0, f"--decoders must be ≥ 0, got {a.decoders}")
    need(_max_pipelines(a) >= a.pipelines, "--max-pipelines must be ≥ --pipelines")
    need(a.max_pipelines is None or a.nodes == 1,
         "--max-pipelines is for --nodes 1 (an HPA scales the pipelines' StatefulSet)")


def render(argv: list[str] | None = None) -> dict[str, str]:
    """{file name: text} for these arguments."""
    a = parser().parse_args(argv)
    check(a)
    command = shlex.join(["python", "deploy/render.py", *(argv or [])])
    objects, replicas = (spanning_pipelines if a.nodes > 1 else node_pipelines)(a)
    decoder_objects, decoder_urls = decoders(a)
    files = {
        "pipelines.yaml": _file(objects, command),
        "router.yaml": _file(router(a, replicas, decoder_urls), command),
    }
    if decoder_objects:
        files["decoders.yaml"] = _file(decoder_objects, command)
    if a.nodes == 1:
        files["hpa.yaml"] = _file([autoscaler(a)], command)
        files["prometheus-adapter.yaml"] = _file([adapter_config(a)], command)
    return dict(sorted(files.items()))


def monitoring() -> dict[str, str]:
    """{file name: text} of deploy/monitoring (no parameters)."""
    return {"prometheus.yml": _file([observability.prometheus_config()],
                                    "python deploy/render.py"),
            "grafana-dashboard.json": observability.dashboard_json()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    for out, files in ((a.out, render(argv)), (a.monitoring_out, monitoring())):
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
        print(f"render: {', '.join(files)} in {out}")


if __name__ == "__main__":
    main()
