"""A decode step reads the device back to the host at most twice, makes no blocking copy to it, and sends its inputs
up in one copy, whatever the batch and the tree.

Every read (``tolist``, ``item``, ``int(t)``, ``if t:``, ``cpu()``, ``cuda.synchronize``) and every blocking copy of
host data to the device (``torch.tensor(..., device=)``, ``host_tensor.to(device)``) is counted during one step; on
a GPU each would stall the step until the device catches up. The one read every step needs is the accepted tokens
of every sequence; a tree that may hold padding (``min_cum_prob``, a batch verify budget) adds the read of its
width. The step's inputs go up through the device's ``Uploads``: one copy per decode step.
"""
import dataclasses

import numpy as np
import pytest
import torch

from eagle_ray.config import SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.engine.host_reads import count_host_reads
from eagle_ray.engine.scheduler import extend_passes
from eagle_ray.engine.clock import Elapsed
from eagle_ray.model.numerics import DEVICE_DEFAULTS
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
    assert one_decode_step(tiny_dir, batch, DEPTH3) == (["engine/model_runner.py:accept tolist"], 1)


def test_sampling_and_plain_steps_read_once_and_copy_once(tiny_dir):
    assert [(len(r), c) for r, c in (one_decode_step(tiny_dir, 4, DEPTH3, temperature=0.8),
                                     one_decode_step(tiny_dir, 4, DEPTH3, speculative=False))] == [(1, 1), (1, 1)]


def test_trees_with_padding_add_only_the_read_of_their_width(tiny_dir, monkeypatch):
    """Counted as a GPU verifies them: in one block (a CPU verifies trees of different sizes in blocks of their own
    widths, each read back: reads cost a CPU nothing, padding rows cost it their compute; tests/test_verify_blocks.py)."""
    monkeypatch.setitem(DEVICE_DEFAULTS, "cpu", dataclasses.replace(DEVICE_DEFAULTS["cpu"], verify_block_tokens=None))
    pruned = TreeConfig(total_tokens=12, depth=3, top_k=3, min_cum_prob=0.01)
    assert [(len(r), c) for r, c in (one_decode_step(tiny_dir, 4, pruned),
                                     one_decode_step(tiny_dir, 8, DEPTH3, verify_cap=40))] == [(2, 1), (2, 1)]


@pytest.mark.parametrize("tree", [TreeConfig(mode="static"), TreeConfig(mode="chain", depth=3)], ids=["static", "chain"])
def test_static_trees_and_chains_send_nothing_from_the_host_while_they_grow(tiny_dir, tree):
    assert one_decode_step(tiny_dir, 4, tree) == (["engine/model_runner.py:accept tolist"], 1)


def test_a_step_where_a_prompt_completes_reads_its_first_token_and_copies_nothing_blocking(tiny_dir):
    """The prompt's chunk joins the decode rows' target pass: its first token is read after that pass, and its
    inputs go up with the step's others, in one staged copy."""
    engine = EagleEngine.from_pretrained(str(tiny_dir), "random", dtype="float32", max_batch_size=8, tree=DEPTH3)
    for i in range(3):
        engine.add_request([5 + i, 9, 10, 11], params=SamplingParams(max_new_tokens=64, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request([5, 6, 7, 8, 9, 10, 11], params=SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1,
                                                                      seed=3))
    upload = uploads_for(engine.device)
    copies = upload.copies
    with count_host_reads() as reads:
        engine.step()
    assert not engine.scheduler.prefilling
    sites = reads.sites
    assert sites[0] == "engine/model_runner.py:finish_prefill tolist"
    assert sites[-1] == "engine/model_runner.py:accept tolist"
    assert len(sites) <= 3 and all(s.endswith(("tolist", "__int__")) for s in sites)   # no blocking copy
    assert upload.copies - copies == 1


def test_the_counter_sees_blocking_copies_to_the_device():
    with count_host_reads() as reads:
        torch.tensor([1, 2], device="cpu")
        host = torch.zeros(3, dtype=torch.long)
        host.to("cpu")
        torch.zeros(2, device="cpu").copy_(torch.from_numpy(np.array([1.0, 2.0])))
        up = Uploads(torch.device("cpu"))
        up.ints([4, 5])                  # pinned and non-blocking on CUDA: not a blocking copy
    assert [s.split(" ", 1)[1] for s in reads.sites] == ["tensor(device=)", "to(device) from the host",
                                                          "copy_ from the host"]


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
