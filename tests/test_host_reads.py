"""A decode step reads the device back to the host at most twice, whatever the batch and the tree.

Every read (``tolist``, ``item``, ``int(t)``, ``if t:``, ``cpu()``, ``cuda.synchronize``) is counted during one step;
on a GPU each would stall the step until the device catches up. The one read every step needs is the accepted
tokens of every sequence; a tree that may hold padding (``min_cum_prob``, a batch verify budget) adds the read of
its width.
"""
import pytest

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.host_reads import count_host_reads


def reads_in_one_decode_step(tiny_dir, batch: int, tree: TreeConfig, speculative: bool = True,
                             temperature: float = 0.0, **options) -> list[str]:
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=8, tree=tree,
                                         **options)
    for i in range(batch):
        engine.add_request([5 + i, 9, 10, 11, 12, 13][: 3 + i % 4], speculative=speculative,
                           params=SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=temperature, seed=i))
    while engine.scheduler.prefilling:   # prompts in, first tokens out
        engine.step()
    engine.step()
    with count_host_reads() as reads:
        touched = engine.step()
    assert len(touched) == batch and not engine.scheduler.prefilling
    return reads.sites


DEPTH3 = TreeConfig(total_tokens=12, depth=3, top_k=3)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_speculative_step_reads_the_device_once(tiny_dir, batch):
    assert reads_in_one_decode_step(tiny_dir, batch, DEPTH3) == ["engine/model_runner.py:verify tolist"]


def test_sampling_and_plain_steps_read_once(tiny_dir):
    assert len(reads_in_one_decode_step(tiny_dir, 4, DEPTH3, temperature=0.8)) == 1
    assert len(reads_in_one_decode_step(tiny_dir, 4, DEPTH3, speculative=False)) == 1


def test_trees_with_padding_add_only_the_read_of_their_width(tiny_dir):
    pruned = TreeConfig(total_tokens=12, depth=3, top_k=3, min_cum_prob=0.01)
    assert len(reads_in_one_decode_step(tiny_dir, 4, pruned)) == 2
    assert len(reads_in_one_decode_step(tiny_dir, 8, DEPTH3, max_verify_tokens=40)) == 2
