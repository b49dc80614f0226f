"""Tree attention over the cache as it lies (flex attention, each row reading only its own slot) equals the dense
masked SDPA path: random trees, ragged prefix lengths, slots in any order, grouped-query heads."""
import pytest
import torch

from eagle_ray.model.attention import make_block_meta, masked_sdpa, with_attention_mask
from eagle_ray.model.kv_cache import KVCache
from eagle_ray.model.tree_attention import flex_tree_attention, tree_block_mask

H, HKV, D = 4, 2, 16


def random_tree(T: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, T]`` bool: node ``i`` sees itself and its ancestors (node 0 the root, each parent earlier)."""
    sees = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        sees[i] |= sees[parent]
    return sees


@pytest.mark.parametrize("slots, lengths, T, valid", [
    ([4, 1, 3], [10, 37, 1], 5, None),              # slots out of order: the dense path gathers, this one does not
    ([0, 1, 2, 3], [3, 60, 17, 129], 8, None),      # contiguous, one row past a key block
    ([5, 2], [40, 7], 6, [6, 2]),                   # a ragged block: row 1 has 2 real tokens, 4 padding
    ([1], [200], 1, None),                          # one-row decode
])
def test_flex_tree_attention_equals_dense_sdpa(slots, lengths, T, valid):
    gen = torch.Generator().manual_seed(sum(lengths) + T)
    cache = KVCache(1, 6, HKV, 256, D, torch.float32, "cpu")
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    for s, n in zip(slots, lengths):
        cache.lengths[s] = n
    trees = torch.stack([random_tree(T, gen) for _ in slots])
    meta = make_block_meta(cache, slots, trees, n_valid=valid)
    q = torch.randn(len(slots), H, T, D, generator=gen)
    k_new, v_new = torch.randn(len(slots), HKV, T, D, generator=gen), torch.randn(len(slots), HKV, T, D, generator=gen)
    cache.write(0, meta.slot_index, meta.write_pos, k_new, v_new)

    keys, values = cache.read(0, meta.slots, meta.kv_len)
    dense = masked_sdpa(q, keys, values, with_attention_mask(meta, H, HKV), D ** -0.5)
    flex = flex_tree_attention(q, cache, 0, meta, tree_block_mask(meta, cache), D ** -0.5)
    real = torch.ones(len(slots), T, dtype=torch.bool) if valid is None else \
        torch.arange(T).view(1, -1) < torch.tensor(valid).view(-1, 1)
    torch.testing.assert_close(flex.transpose(1, 2)[real], dense.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)


def test_the_block_mask_skips_other_slots_and_keys_past_each_rows_length():
    cache = KVCache(1, 4, HKV, 1023, D, torch.float32, "cpu")
    cache.lengths[[2, 0]] = [100, 700]
    meta = make_block_meta(cache, [2, 0], torch.ones(2, 1, 1, dtype=torch.bool))
    blocks = tree_block_mask(meta, cache).kv_num_blocks[:, 0, 0].tolist()   # key blocks of 128 each slot reads
    assert blocks == [6, 0, 1, 0]   # slot 0: 701 keys; slot 2: 101 keys; slots 1 and 3 hold no row
