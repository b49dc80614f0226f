"""Tensor parallelism inside one engine: the target's layers split over N processes, Megatron style.

q/k/v and gate/up are split by output rows (each rank holds ``H / N`` query heads, ``Hkv / N`` KV heads and
``I / N`` MLP columns), o and down by input columns; each rank's o and down products are partial sums, added by one
all-reduce after attention and one after the MLP. The embedding and the lm_head are replicated: a step reads only
its rows of the embedding, and a replicated lm_head keeps the logits (and the trees, acceptance and sampling built on
them) on rank 0 without gathering ``batch x width x vocab`` values every pass. The KV cache of a rank holds its own
heads only. Each rank reads only its slices of the safetensors files (``safe_open(...).get_slice``).

Rank 0 is the engine: the scheduler, the head, the trees, acceptance and sampling run there, unchanged. Every call
that touches the target's shards (a forward, moving accepted K/V, moving a slot) is sent first to the other ranks,
which run the same call on their shards (``follow``); the forward's all-reduces keep the ranks in step. A rank that
dies makes the next collective fail at once, one that hangs makes it fail after ``timeout_s``: either way rank 0
raises :class:`EngineDeadError` naming the rank, never hangs.

Collectives go through ``torch.distributed`` process groups made for the engine (gloo on CPU, NCCL on CUDA) over a
``TCPStore`` on 127.0.0.1, so several engines can live in one process; calls go to the other ranks over pipes.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from eagle_ray.errors import CheckpointError, EngineDeadError, first_line

COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # output rows by rank
ROW_SPLIT = ("o_proj", "down_proj")                                      # input columns by rank


def check_shardable(cfg, world: int) -> None:
    """Heads, KV heads and MLP columns must split evenly over the ranks; fails naming both numbers."""
    for what, n in (("attention heads", cfg.num_attention_heads), ("KV heads", cfg.num_key_value_heads),
                    ("MLP columns (intermediate_size)", cfg.intermediate_size)):
        if n % world:
            raise CheckpointError(f"tensor_parallel {world} does not divide the target's {n} {what}")


def split_dim(name: str) -> int | None:
    """The dimension of tensor ``name`` that ranks split (None: every rank holds all of it)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLUMN_SPLIT:
        return 0
    if module in ROW_SPLIT and parts[-1] == "weight":
        return 1
    return None


def load_shard(path: str | Path, cfg, dtype: torch.dtype, device, rank: int, world: int, group: "Group | None" = None):
    """The transformers model of ``cfg`` holding rank ``rank``'s shard of the safetensors in ``path``: built empty
    (meta device), each tensor read as its slice only; with ``group``, its o and down projections sum their partial
    products over the group (:class:`RowParallel`)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    check_shardable(cfg, world)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"target {path} has no safetensors files: tensor parallelism reads shards from them")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    params = dict(hf.named_parameters())
    loaded = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if name not in params:
                    continue
                piece = st.get_slice(name)
                dim = split_dim(name)
                if dim is None:
                    t = piece[:]
                else:
                    size = piece.get_shape()[dim] // world
                    index = [slice(None)] * len(piece.get_shape())
                    index[dim] = slice(rank * size, (rank + 1) * size)
                    t = piece[tuple(index)]
                owner, _, attr = name.rpartition(".")
                module = hf.get_submodule(owner)
                setattr(module, attr, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
                loaded.add(name)
    if getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in loaded:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"target {path} lacks {len(missing)} of the model's tensors ({', '.join(missing[:4])})")
    rotary = hf.model.rotary_emb   # its frequency table is a computed buffer: made again, then moved
    hf.model.rotary_emb = type(rotary)(config=cfg).to(device)
    if group is not None:
        for layer in hf.model.layers:
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    return hf.eval()


class RowParallel(nn.Module):
    """o_proj / down_proj of a shard: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Linear, group: "Group"):
        super().__init__()
        self.weight, self.group = linear.weight, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


@dataclass
class Spec:
    """What a rank needs to build its shard of the target (sent to the other ranks when they start)."""
    path: str
    config: object
    dtype: str
    device: str
    max_slots: int
    max_len: int
    precision: dict
    threads: int | None = None


class Group:
    """This rank's side of the engine's process group: the all-reduce the layers call, and (rank 0) the calls and
    the other ranks' processes."""

    def __init__(self, rank: int, world: int, host: str, port: int, backend: str, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.store = dist.TCPStore(host, port, world, rank == 0, timedelta(seconds=timeout_s))
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.procs: list = []    # rank 0: the other ranks' processes and pipes, and what they were started with
        self.pipes: list = []
        self.spec: Spec | None = None
        self.make_target = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self.pg.allreduce([t]).wait()
        except Exception as e:   # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses of many kinds
            raise EngineDeadError(f"tensor-parallel all-reduce failed on rank {self.rank}: {self.state()}"
                                  f"({type(e).__name__}: {first_line(e)})") from None
        return t

    def state(self) -> str:
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in enumerate(self.procs, 1)
                if not p.is_alive()]
        return "; ".join(dead) + " " if dead else ""

    def send(self, *call) -> None:
        """Rank 0: ``call`` to every other rank (they run it on their shards). Its tensors travel as host copies:
        a CUDA tensor through a pipe would be shared by IPC and freed under the receiver (a GPU run pays one device
        read per call; sending them over the group is the next step)."""
        call = tuple(a.cpu() if torch.is_tensor(a) and a.device.type != "cpu" else a for a in call)
        for r, (proc, pipe) in enumerate(zip(self.procs, self.pipes), 1):
            if not proc.is_alive():
                raise EngineDeadError(f"tensor-parallel rank {r} (pid {proc.pid}) exited with code {proc.exitcode}")
            try:
                pipe.send(call)
            except (OSError, EOFError) as e:
                raise EngineDeadError(f"tensor-parallel rank {r} (pid {proc.pid}) is unreachable: {e}") from None

    def restarted(self) -> "Group":
        """Rank 0: the other ranks stopped and started again (their shards loaded again) in a new group: after a
        failed step their state, or their process, is in doubt; rank 0's shard stays loaded."""
        self.close()
        return start_ranks(self.spec, self.world, self.make_target, self.timeout_s)

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop",))
            except (OSError, EOFError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs, self.pipes = [], []


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(spec: Spec, world: int, make_target, timeout_s: float = 30.0):
    """Start ranks 1..N-1 (each loads its shard and follows), join the group as rank 0 and load shard 0; returns
    rank 0's :class:`Group` and transformers model."""
    group = start_ranks(spec, world, make_target, timeout_s)
    try:
        return group, load_shard(spec.path, spec.config, getattr(torch, spec.dtype), torch.device(spec.device), 0,
                                 world, group)
    except Exception:
        group.close()
        raise


def start_ranks(spec: Spec, world: int, make_target, timeout_s: float) -> Group:
    """Ranks 1..N-1 started (each loads its shard and follows) and rank 0's side of a new group."""
    device = torch.device(spec.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    port = free_port()
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=follow, args=(spec, rank, world, port, backend, timeout_s, theirs, make_target),
                           daemon=True, name=f"eagle-ray-tp-rank{rank}")
        proc.start()
        procs.append(proc)
        pipes.append(ours)
    try:
        group = Group(0, world, "127.0.0.1", port, backend, timeout_s)
    except Exception as e:   # noqa: BLE001
        for p in procs:
            p.kill()
        raise EngineDeadError(f"tensor-parallel ranks did not join within {timeout_s:.0f} s: {first_line(e)}") from None
    group.procs, group.pipes, group.spec, group.make_target = procs, pipes, spec, make_target
    return group


def follow(spec: Spec, rank: int, world: int, port: int, backend: str, timeout_s: float, pipe, make_target) -> None:
    """A rank other than 0: load the shard, build its target runtime with ``make_target`` (``TargetModel``), then run
    every call rank 0 sends until it says stop or goes away."""
    try:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank if device.index is None else device.index + rank)
            torch.cuda.set_device(device)
        group = Group(rank, world, "127.0.0.1", port, backend, timeout_s)
        hf = load_shard(spec.path, spec.config, getattr(torch, spec.dtype), device, rank, world, group)
        target = make_target(hf, spec.max_slots, spec.max_len, tp=group, **spec.precision)
        with torch.inference_mode():
            while True:
                try:
                    call = pipe.recv()
                except EOFError:   # rank 0 is gone
                    return
                if call[0] == "stop":
                    return
                run_call(target, call)
    except Exception:   # noqa: BLE001 - whatever it was, rank 0's next collective fails and names this rank
        traceback.print_exc()
        os._exit(1)


def run_call(target, call) -> None:
    """Run one of rank 0's calls on this rank's shard."""
    name, *args = call
    cache = target.cache
    if name == "forward":
        tokens, slots, lengths, depth, block_mask, n_valid, capture, graphed = args
        cache.lengths[slots] = lengths
        target.forward(tokens, slots, depth, block_mask, n_valid=n_valid, capture=capture, graphed=graphed)
    elif name == "forward_parts":
        blocks, capture = args
        for _, slots, lengths, *_ in blocks:
            cache.lengths[slots] = lengths
        target.forward_parts([(t, s, d, m, n) for t, s, _, d, m, n in blocks], capture)
    elif name == "keep_accepted":
        cache.keep_accepted(*args)
    elif name == "move":
        src, dst, n = args
        cache.lengths[src] = n
        cache.move(src, dst)
    elif name == "copy_prefix":
        cache.copy_prefix(*args)
    else:
        raise ValueError(f"unknown tensor-parallel call {name!r}")
