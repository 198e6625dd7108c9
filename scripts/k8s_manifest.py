"""A Kubernetes Deployment, Service and model-cache claim for a containerized Bento.

    bentoml build && bentoml containerize pagedserve:latest
    python scripts/k8s_manifest.py pagedserve:latest --replicas 3 > pagedserve.yaml
    kubectl apply -f pagedserve.yaml

Everything comes from the Bento's own record (bento.yaml): the image tag is the Bento
tag, as `bentoml containerize` names it; the GPU, CPU and memory requests are the
service's `resources`; the grace period covers the preset's drain_timeout. Readiness is
BentoML's /readyz, which turns false as soon as a drain starts; liveness is /livez.
The cache volume keeps the native kernel build, Triton's cache and any HF-cache models
across pod restarts (the weights of an imported model are in the image already).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

CACHE = "/cache"  # shared by the replicas: models served by HF id
SCRATCH = "/scratch"  # per pod
PORT = 3000


def service_config(tag: str) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(name:version, the service's BentoML config, the image's environment) from the store."""
    import bentoml

    bento = bentoml.get(tag)
    info = bento.info
    config = dict(info.services[0].config or {}) if info.services else {}
    envs = {e.name: str(e.value or "") for e in (info.envs or [])}
    return f"{bento.tag.name}:{bento.tag.version}", config, envs


def drain_timeout(envs: dict[str, str]) -> float:
    """The drain timeout of the preset the image runs (its PAGEDSERVE_CONFIG)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from engine.serving.preset import load_preset

    return load_preset(envs.get("PAGEDSERVE_CONFIG") or None).service.drain_timeout


def manifest(name: str, image: str, config: dict[str, Any], envs: dict[str, str], replicas: int,
             cache_size: str, api_key_secret: str | None, grace: float) -> list[dict[str, Any]]:
    res = config.get("resources") or {}
    requests: dict[str, Any] = {}
    if res.get("cpu") is not None:
        requests["cpu"] = str(res["cpu"])
    if res.get("memory") is not None:
        requests["memory"] = str(res["memory"])
    limits = dict(requests)
    if res.get("gpu"):
        limits["nvidia.com/gpu"] = int(res["gpu"])  # extended resources go in limits
    env = [{"name": k, "value": v} for k, v in sorted(envs.items())]
    env += [
        # What a pod writes (kernel builds, Triton's cache, dequantized GGUFs) is its own: on
        # a volume every replica shares, two pods building or converting at once write over
        # each other's files. The shared volume holds only models read by HF id.
        {"name": "PAGEDSERVE_CACHE", "value": f"{SCRATCH}/pagedserve"},
        {"name": "TORCH_EXTENSIONS_DIR", "value": f"{SCRATCH}/torch_extensions"},
        {"name": "TRITON_CACHE_DIR", "value": f"{SCRATCH}/triton"},
        {"name": "HF_HOME", "value": f"{CACHE}/huggingface"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if api_key_secret:
        env.append({"name": "LLM_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": api_key_secret, "key": "api-key"}}})
    labels = {"app.kubernetes.io/name": name}
    probe = {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3}
    container = {
        "name": name,
        "image": image,
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": env,
        "readinessProbe": probe,
        # Loading weights and building kernels on a cold cache: up to 20 minutes before live.
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "resources": {k: v for k, v in (("requests", requests), ("limits", limits)) if v},
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE, "readOnly": replicas > 1},
                         {"name": "scratch", "mountPath": SCRATCH},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": int(grace) + 30,  # SIGTERM drains for up to drain_timeout
        "containers": [container],
        "volumes": [
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": f"{name}-model-cache"}},
            {"name": "scratch", "emptyDir": {"sizeLimit": "20Gi"}},  # this pod's own caches
            # Parallel ranks and the engine process share memory through /dev/shm; Docker's 64 MiB is too small.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        ],
    }
    if limits.get("nvidia.com/gpu"):
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return [
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": f"{name}-model-cache"},
         # every replica mounts the same cache: ReadWriteMany storage (NFS, EFS, Filestore)
         "spec": {"accessModes": ["ReadWriteMany" if replicas > 1 else "ReadWriteOnce"],
                  "resources": {"requests": {"storage": cache_size}}}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
         "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                  "template": {"metadata": {"labels": labels}, "spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
    ]


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # plain repeated values, no &anchors, for reviewers
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bento", help="a Bento tag in the local store, e.g. pagedserve:latest")
    ap.add_argument("--image", help="image reference (default: the Bento tag, as bentoml containerize names it)")
    ap.add_argument("--name", default="pagedserve")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--cache-size", default="50Gi")
    ap.add_argument("--api-key-secret", help="a Secret with key api-key, passed as LLM_API_KEY")
    args = ap.parse_args()
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    tag, config, envs = service_config(args.bento)
    docs = manifest(args.name, args.image or tag, config, envs, args.replicas, args.cache_size,
                    args.api_key_secret, drain_timeout(envs))
    sys.stdout.write(yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False))


if __name__ == "__main__":
    main()
