import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# torch, transformers and eagle_ray are imported where a fixture needs them, not here: under pytest-xdist the
# controlling process loads this file too, runs no test, and would spend seconds importing them before it starts
# the test processes.


# Each test process runs torch on its share of the cores: the tiers run on as many processes as the machine has
# cores (pytest-xdist, scripts/test.sh), and two processes of two threads each on two cores would fight.
THREADS = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(autouse=True)
def _threads():
    import torch
    torch.set_num_threads(min(2, THREADS))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from tiny import save_target
    return save_target(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_head(tiny_hf):
    """A head trained for a few seconds on the tiny target's own greedy outputs: it drafts well enough that
    multi-token acceptance, KV compaction and every tree path are exercised."""
    from tiny import trained_head
    return trained_head(tiny_hf)


@pytest.fixture()
def s3(monkeypatch, tmp_path):
    """A real S3 API on loopback (moto's server) with a ``models`` bucket; yields (s3fs filesystem, options)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EAGLE_RAY_CACHE", str(tmp_path / "cache"))
    import s3fs
    opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    fs = s3fs.S3FileSystem(**opts)
    if not fs.exists("models"):  # moto's backend is per process: buckets outlive a server
        fs.mkdir("models")
    yield fs, opts
    server.stop()


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray bound to 127.0.0.1 (started once per test session, shut down at the end), its own whatever
    the machine holds (a running head, a stale record of one, RAY_ADDRESS), with one logical GPU for the
    scheduling tests (nothing uses CUDA). Workers inherit these AWS variables, so actors reach the test S3 server
    the way they reach a real one."""
    import ray
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                 "RAY_USAGE_STATS_ENABLED": "0", "EAGLE_RAY_TEST_API_KEY": "test-key",
                 # Ray Data's progress bars replace builtins.print in this process once a dataset runs, and a
                 # function pickled by value later (bench/speed.py's table1 on Ray) no longer finds print there
                 "RAY_TQDM_PATCH_PRINT": "0"}.items():
        os.environ.setdefault(k, v)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, num_gpus=1,
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pair(tiny_dir, tiny_head, tmp_path_factory):
    """The tiny target's folder and the tiny head saved beside it: what a job or a cluster scenario loads."""
    head = tmp_path_factory.mktemp("head")
    tiny_head.save(head)
    return str(tiny_dir), str(head)
