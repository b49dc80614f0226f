"""Weights from s3:// (a real S3 API: moto's server on 127.0.0.1) load into the same engine as local files."""
import os

import torch

from eagle_ray.config import SamplingParams
from eagle_ray.engine.engine import EagleEngine


def test_target_and_head_from_s3(s3, tiny_dir, tiny_head, tmp_path):
    fs, opts = s3
    tiny_head.save(tmp_path / "head")
    fs.put(str(tiny_dir) + "/", "models/tiny/", recursive=True)
    fs.put(str(tmp_path / "head") + "/", "models/tiny-head/", recursive=True)
    remote = EagleEngine.from_pretrained(target="s3://models/tiny", draft="s3://models/tiny-head", dtype="float32",
                                         max_model_len=128, storage_options=opts)
    local = EagleEngine.from_pretrained(target=str(tiny_dir), draft=str(tmp_path / "head"), dtype="float32",
                                        max_model_len=128)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    assert remote.generate(prompt, params)[0].token_ids == local.generate(prompt, params)[0].token_ids
    cached = os.listdir(tmp_path / "cache" / "s3")
    assert len(cached) == 2 and all(os.path.exists(tmp_path / "cache" / "s3" / c / ".complete") for c in cached)
    for a, b in zip(remote.draft.state_dict().values(), local.draft.state_dict().values()):
        assert torch.equal(a, b)
