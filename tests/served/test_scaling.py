"""The scaling docs' configuration, exercised: docs/scaling.md and docs/routing.md."""

from __future__ import annotations

import hashlib
import re
import struct
import subprocess
import sys

import pytest
import yaml

from engine.errors import ParamError
from tests.support.server import BIN, ROOT, offline_env


def test_gpu_preset_builds_with_its_scaling_settings_and_makes_a_k8s_manifest(bento_home):
    env = {**offline_env(bento_home), "PAGEDSERVE_CONFIG": "config/gpu.yaml"}
    out = subprocess.run([str(BIN / "bentoml"), "build", ".", "--output", "tag"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tag = re.search(r"__tag__:(\S+)", out.stdout).group(1)
    name, version = tag.split(":")
    record = yaml.safe_load((bento_home / "bentos" / name / version / "bento.yaml").read_text())
    config = record["services"][0]["config"]
    assert config["workers"] == 1
    assert config["traffic"]["concurrency"] == 256 and config["traffic"]["external_queue"] is True
    assert config["resources"]["gpu"] == 1 and config["resources"]["gpu_type"] == "nvidia-l4"

    out = subprocess.run([sys.executable, "scripts/k8s_manifest.py", tag, "--replicas", "3",
                          "--api-key-secret", "llm-key"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    docs = {d["kind"]: d for d in yaml.safe_load_all(out.stdout)}
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service"}
    deploy = docs["Deployment"]
    assert deploy["spec"]["replicas"] == 3
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == tag
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    assert pod["terminationGracePeriodSeconds"] > 60  # gpu.yaml's drain_timeout (the default, 60 s)
    env_vars = {e["name"]: e for e in container["env"]}
    assert env_vars["PAGEDSERVE_CONFIG"]["value"] == "config/gpu.yaml"
    assert env_vars["LLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "llm-key"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert env_vars["HF_HOME"]["value"].startswith(mounts["model-cache"])
    # what a pod writes is its own: never on the volume the replicas share
    for var in ("PAGEDSERVE_CACHE", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR"):
        assert env_vars[var]["value"].startswith(mounts["scratch"]) and "emptyDir" in volumes["scratch"]
    assert {m["name"]: m.get("readOnly", False) for m in container["volumeMounts"]}["model-cache"]
    claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    service = docs["Service"]["spec"]
    assert service["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert service["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_bentocloud_deployment_file_is_what_bentoml_deploy_reads():
    from bentoml._internal.cloud.schemas.schemasv2 import CreateDeploymentSchema
    from bentoml._internal.cloud.schemas.utils import cloud_converter

    data = yaml.safe_load((ROOT / "deploy/bentocloud.yaml").read_text())
    schema = cloud_converter.structure(data, CreateDeploymentSchema)

    def present(d):  # what bentoml reads back, less the fields it fills with defaults
        if isinstance(d, dict):
            return {k: present(v) for k, v in d.items() if v is not None and v != {} and (k, v) != ("dev", False)}
        return d

    assert present(cloud_converter.unstructure(schema)) == data  # every key in the file is one it reads
    bento_name = yaml.safe_load((ROOT / "bentofile.yaml").read_text())["name"]
    assert schema.name == bento_name and schema.bento == f"{bento_name}:latest"
    assert list(schema.services) == [bento_name]  # the service's name in service.py (@bentoml.service)
    scaling = schema.services[bento_name].scaling
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    # the deployment that is open to the internet needs the key the service checks
    assert schema.access_authorization is True and schema.secrets == ["pagedserve-api-key"]
    assert schema.services[bento_name].cold_start_timeout >= 600  # weights and kernels on a fresh node


def test_a_preset_with_fewer_gpus_than_ranks_is_refused(tmp_path):
    from engine.serving.preset import load_preset

    text = (ROOT / "config/gpu.yaml").read_text().replace("tensor_parallel_size: 1", "tensor_parallel_size: 2")
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ParamError, match="resources.gpu"):
        load_preset(tmp_path / "p.yaml")


def test_routing_docs_block_hashes_are_the_engines(tokenizer):
    """docs/routing.md's formula, computed independently, gives the prefix cache's keys."""
    from engine.kv_cache_manager import KVCacheManager
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

    ids = tokenizer.encode("You are a helpful assistant. " * 30)
    for salt in (None, "tenant-a"):
        seq = Sequence(0, "r", 0, ids, SamplingParams(max_tokens=1), 1, cache_salt=salt)
        manager = KVCacheManager(64, 16)
        manager.find_cached(seq)  # hashes the full blocks as the scheduler does
        parent = b"\0" * 32
        for i, got in enumerate(seq.block_hashes):
            extra = (salt or "").encode() if i == 0 else b""
            block = struct.pack(f"<{16}q", *ids[i * 16:(i + 1) * 16])
            parent = hashlib.sha256(parent + block + struct.pack("<I", len(extra)) + extra).digest()
            assert got == parent, f"block {i}"
        assert len(seq.block_hashes) == len(ids) // 16 > 8
