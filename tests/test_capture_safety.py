"""What CUDA graph capture needs of the forwards, held on the CPU: given its block meta, a target or head forward
(``run_block``) reads nothing back to the host, makes no blocking copy up, runs no operation whose output shape
depends on data, and run again on the same buffers (the cache as it was) gives the same result. A forward that
broke any of these would capture a graph that replays wrongly or not at all."""
import pytest
import torch
from tiny import make_target
from torch.utils._python_dispatch import TorchDispatchMode

from eagle_ray.engine.host_reads import count_host_reads
from eagle_ray.model.attention import make_block_meta
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.eagle3_head import Eagle3Head
from eagle_ray.model.target import TargetModel

# data-dependent output shapes, or a read of a tensor's value on the host
UNCAPTURABLE = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                "unique_dim", "repeat_interleave", "bincount", "histc", "item", "equal"}


class Uncapturable(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in UNCAPTURABLE:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def block(B: int, T: int):
    idx = torch.arange(T)
    return (idx.view(-1, 1) >= idx.view(1, -1)).expand(B, T, T), idx.expand(B, T)


def replayed_twice(run, cache):
    """``run()`` twice from the same cache contents (as a graph replays over its static buffers)."""
    saved = cache.k.clone(), cache.v.clone()
    with count_host_reads() as reads, Uncapturable() as mode:
        first = run()
    cache.k.copy_(saved[0])
    cache.v.copy_(saved[1])
    second = run()
    return first, second, reads.count, mode.seen


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
def test_the_target_forward_is_capture_safe(fused):
    """(Flex tree attention compiles itself, which a dispatch mode cannot look into: the GPU run checks it.)"""
    hf = make_target(layers=2)
    target = TargetModel(hf, 4, 64, fp32_logits=False, fp32_activations=False, batch_invariant=False,
                         cpu_linears="native", fused_layers=fused)
    target.cache.lengths[[2, 0, 3]] = [5, 17, 9]   # slots out of order: the gathered read, the harder case
    mask, depth = block(3, 4)
    meta = make_block_meta(target.cache, [2, 0, 3], mask)
    tokens = torch.randint(3, 60, (3, 4))
    with torch.inference_mode():
        first, second, reads, seen = replayed_twice(lambda: target.logits(target.run_block(tokens, depth, meta)),
                                                    target.cache)
    assert (reads, seen) == (0, [])
    assert torch.equal(first, second)


@pytest.mark.parametrize("head_kind", [DraftHead, Eagle3Head])
def test_the_head_forward_is_capture_safe(head_kind):
    hf = make_target(layers=7)   # an EAGLE-3 head reads three distinct target layers
    torch.manual_seed(0)
    head = head_kind.for_target(hf.config).eval()
    head.allocate_cache(4, 64)
    cache = head.cache
    cache.lengths[[1, 3]] = [6, 11]
    mask, depth = block(2, 3)
    meta = make_block_meta(cache, [1, 3], mask)
    tokens = torch.randint(3, 60, (2, 3))
    features = torch.randn(2, 3, head.feature_size)
    with torch.inference_mode():
        first, second, reads, seen = replayed_twice(lambda: head.run_block(tokens, features, depth, meta), cache)
    assert (reads, seen) == (0, [])
    assert torch.equal(first, second)
