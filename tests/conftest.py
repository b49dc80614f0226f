import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_target, trained_head  # noqa: E402


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_target(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_head(tiny_hf):
    """A head trained for a few seconds on the tiny target's own greedy outputs: it drafts well enough that
    multi-token acceptance, KV compaction and every tree path are exercised."""
    return trained_head(tiny_hf)
