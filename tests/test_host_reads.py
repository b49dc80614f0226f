"""A decode step reads the device back to the host at most twice and sends its inputs up in one copy, whatever the
batch and the tree.

Every read (``tolist``, ``item``, ``int(t)``, ``if t:``, ``cpu()``, ``cuda.synchronize``) is counted during one step;
on a GPU each would stall the step until the device catches up. The one read every step needs is the accepted
tokens of every sequence; a tree that may hold padding (``min_cum_prob``, a batch verify budget) adds the read of
its width. Host-to-device copies are counted by the device's ``Uploads``: one per decode step.
"""
import numpy as np
import pytest
import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.host_reads import count_host_reads
from eagle_ray.engine.scheduler import extend_passes
from eagle_ray.engine.clock import Elapsed
from eagle_ray.uploads import Uploads, uploads_for


def one_decode_step(tiny_dir, batch: int, tree: TreeConfig, speculative: bool = True, temperature: float = 0.0,
                    **options) -> tuple[list[str], int]:
    """(the sites of the device reads, the host-to-device copies) of one decode step."""
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=8, tree=tree,
                                         **options)
    for i in range(batch):
        engine.add_request([5 + i, 9, 10, 11, 12, 13][: 3 + i % 4], speculative=speculative,
                           params=SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=temperature, seed=i))
    while engine.scheduler.prefilling:   # prompts in, first tokens out
        engine.step()
    engine.step()
    upload = uploads_for(engine.device)
    copies, misses = upload.copies, upload.misses
    with count_host_reads() as reads:
        touched = engine.step()
    assert len(touched) == batch and not engine.scheduler.prefilling
    assert upload.misses == misses   # every input the step sent was staged
    return reads.sites, upload.copies - copies


DEPTH3 = TreeConfig(total_tokens=12, depth=3, top_k=3)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_speculative_step_reads_the_device_once_and_copies_to_it_once(tiny_dir, batch):
    assert one_decode_step(tiny_dir, batch, DEPTH3) == (["engine/model_runner.py:verify tolist"], 1)


def test_sampling_and_plain_steps_read_once_and_copy_once(tiny_dir):
    assert [(len(r), c) for r, c in (one_decode_step(tiny_dir, 4, DEPTH3, temperature=0.8),
                                     one_decode_step(tiny_dir, 4, DEPTH3, speculative=False))] == [(1, 1), (1, 1)]


def test_trees_with_padding_add_only_the_read_of_their_width(tiny_dir):
    pruned = TreeConfig(total_tokens=12, depth=3, top_k=3, min_cum_prob=0.01)
    assert [(len(r), c) for r, c in (one_decode_step(tiny_dir, 4, pruned),
                                     one_decode_step(tiny_dir, 8, DEPTH3, verify_cap=40))] == [(2, 1), (2, 1)]


def test_staged_inputs_are_served_from_one_copy_and_others_are_sent_alone():
    up = Uploads(torch.device("cpu"))
    up.stage([[3, 1], np.array([7, 8, 9]), Uploads.float_bits([0.5, 1.0]), [3, 1]])
    assert up.copies == 1
    assert up.ints([[7, 8, 9]]).tolist() == [[7, 8, 9]] and up.ints([3, 1]).tolist() == [3, 1]
    assert up.floats([0.5, 1.0]).tolist() == [0.5, 1.0] and (up.copies, up.misses) == (1, 0)
    assert up.ints([4]).tolist() == [4] and (up.copies, up.misses) == (2, 1)
    up.clear()
    assert up.ints([3, 1]).tolist() == [3, 1] and up.misses == 2


def test_extend_passes_put_short_pending_lists_together_and_split_long_ones():
    assert extend_passes([3, 0, 5000, 2], 512) == [[(3, 2), (0, 3)]] + [[(2, 512)]] * 9 + [[(2, 392)]]
    assert extend_passes([], 512) == [] and extend_passes([0, 0], 512) == []


def test_profiled_phase_times_add_up_event_spans_and_seconds():
    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms
    total = 0.0 + Elapsed([(Event(0), Event(250))]) + 0.5 + Elapsed([(Event(10), Event(260))])
    assert total.seconds() == 1.0
