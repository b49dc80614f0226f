"""Tensor parallelism inside one engine: the target's layers split over N processes, Megatron style.

q/k/v and gate/up are split by output rows (each rank holds ``H / N`` query heads, ``Hkv / N`` KV heads and
``I / N`` MLP columns), o and down by input columns; each rank's o and down products are partial sums, added by one
all-reduce after attention and one after the MLP. The embedding and the lm_head are replicated: a step reads only
its rows of the embedding, and a replicated lm_head keeps the logits (and the trees, acceptance and sampling built on
them) on rank 0 without gathering ``batch x width x vocab`` values every pass. The KV cache of a rank holds its own
heads only. Each rank reads only its slices of the safetensors files (``safe_open(...).get_slice``).

Rank 0 is the engine: the scheduler, the head, the trees, acceptance and sampling run there, unchanged. The engine
holds a :class:`ShardedTarget`, a target like any other: each of its methods that touches the shards (a forward,
moving accepted K/V, moving or copying a slot) sends a typed call (:class:`Forward`, :class:`KeepAccepted`...) to the
other ranks first, which run it on their shards (``follow``); the forward's all-reduces keep the ranks in step. The
layers see tensor parallelism only through :class:`RowSum`, the hook that sums a row-split product over the ranks. All
that knows about ranks is in this module. A rank that dies makes the next collective fail at once, one that hangs
makes it fail after ``timeout_s``: either way rank 0 raises :class:`EngineDeadError` naming the rank, never hangs.

Collectives go through ``torch.distributed`` process groups made for the engine (gloo on CPU, NCCL on CUDA) over a
``TCPStore`` on 127.0.0.1, so several engines can live in one process; calls go to the other ranks over pipes.
"""
from __future__ import annotations

import ast
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from eagle_ray.errors import CheckpointError, EngineDeadError, first_line
from eagle_ray.model import decoder

COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # output rows by rank
ROW_SPLIT = ("o_proj", "down_proj")                                      # input columns by rank
DEATH_GRACE_S = 2.0   # how long a failed all-reduce waits to see which rank died (a loaded host is slow to reap)


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


def load_shard(path: str | Path, cfg, dtype: torch.dtype, device, rank: int, world: int,
               row_sum: "RowSum | None" = None):
    """The model of ``cfg`` holding rank ``rank``'s shard of the safetensors in ``path`` (``decoder.load``, each
    tensor read as its slice only); with ``row_sum``, its o and down projections sum their partial products over
    the ranks (:class:`RowParallel`)."""
    check_shardable(cfg, world)
    if not decoder.weight_files(Path(path)):
        raise CheckpointError(f"target {path} has no safetensors files: tensor parallelism reads shards from them")

    def shard(name, piece):
        dim = split_dim(name)
        if dim is None:
            return None
        size = piece.get_shape()[dim] // world
        index = [slice(None)] * len(piece.get_shape())
        index[dim] = slice(rank * size, (rank + 1) * size)
        return piece[tuple(index)]

    model = decoder.load(path, cfg, dtype, device, shard)
    if row_sum is not None:
        for layer in model.model.layers:
            layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, row_sum)
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, row_sum)
    return model


class RowSum:
    """The one hook the layers of a shard hold: a row-split product's partial sums added over the ranks. One per
    rank, shared by its layers (and, on rank 0, by the sharded target and cache), so a restarted group is taken by
    swapping ``group`` here alone."""

    def __init__(self, group: "Group"):
        self.group = group

    @property
    def world(self) -> int:
        return self.group.world

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def residual_gemm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` summed over the ranks in one all-reduce: each rank adds its partial product,
        rank 0 alone the residual."""
        if self.group.rank == 0:
            return self.group.all_reduce(torch.addmm(residual, x, weight.t()))
        return self.group.all_reduce(torch.mm(x, weight.t()))


class RowParallel(nn.Module):
    """o_proj / down_proj of a shard: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: nn.Linear, row_sum: RowSum):
        super().__init__()
        self.weight, self.row_sum = linear.weight, row_sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row_sum(F.linear(x, self.weight))


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
            # a dying rank's connections reset a moment before its process is seen to exit: wait that moment, so
            # the error names the rank that died rather than only the reset
            raise EngineDeadError(f"tensor-parallel all-reduce failed on rank {self.rank}: "
                                  f"{self.state(grace_s=DEATH_GRACE_S)}({type(e).__name__}: {first_line(e)})") from None
        return t

    def state(self, grace_s: float = 0.0) -> str:
        """The other ranks that exited (rank 0 knows them), waiting up to ``grace_s`` for one to."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in enumerate(self.procs, 1)
                    if not p.is_alive()]
            if dead or not self.procs or time.monotonic() >= deadline:
                return "; ".join(dead) + " " if dead else ""
            time.sleep(0.05)

    def send(self, call: "Call") -> None:
        """Rank 0: ``call`` to every other rank (they run it on their shards). Its tensors travel as host copies:
        a CUDA tensor through a pipe would be shared by IPC and freed under the receiver (a GPU run pays one device
        read per call; sending them over the group is the next step)."""
        call = type(call)(*(on_host(getattr(call, f.name)) for f in fields(call)))
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
                pipe.send(Stop())
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


def start(spec: Spec, world: int, make_target, timeout_s: float) -> "ShardedTarget":
    """Start ranks 1..N-1 (each loads its shard and follows), join the group as rank 0 and load shard 0; returns
    the target the engine holds (rank 0's shard, built by ``make_target``, ``TargetModel``)."""
    group = start_ranks(spec, world, make_target, timeout_s)
    try:
        row_sum = RowSum(group)
        hf = load_shard(spec.path, spec.config, getattr(torch, spec.dtype), torch.device(spec.device), 0, world,
                        row_sum)
        return ShardedTarget(make_target(hf, spec.max_slots, spec.max_len, row_sum=row_sum, **spec.precision),
                             row_sum)
    except Exception:
        group.close()
        raise


MAIN_GUARD_EXIT = 3   # a rank's exit status when it was about to start ranks of its own (see check_not_spawning)
MAIN_GUARD = ('the script that builds a tensor-parallel engine has no `if __name__ == "__main__":` guard: each rank '
              "is a new Python process (multiprocessing's fork server) that imports the script again, so every rank "
              "ran the script and tried to build an engine of its own. Put the code that builds the engine under "
              '`if __name__ == "__main__":`')


class NoMainGuard(RuntimeError):
    """The script that starts ranks runs again in each of them: it lacks ``if __name__ == "__main__":``."""


def called_from_unguarded_main() -> bool:
    """Whether this call comes from the main script's top level outside the body of an ``if __name__ ==
    "__main__":`` block: every spawned rank would run that line again. Read from the main script's source, so a
    script without the guard fails before a rank starts (a rank would see it too, after importing the script:
    :func:`check_not_spawning`); no source to read (``python -c``, a notebook) says no."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or not path:
        return False
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    line = frame.f_lineno
    return not any(isinstance(node, ast.If) and _is_main_test(node.test)
                   and node.body[0].lineno <= line <= node.body[-1].end_lineno for node in ast.walk(tree))


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def check_not_spawning() -> None:
    """Called where ranks are about to start: in a rank still importing the main script (a script without the main
    guard runs its engine-building code again there), exit with :data:`MAIN_GUARD_EXIT` at once; rank 0 reads that
    status and says what to fix, instead of waiting out the join timeout."""
    from multiprocessing import process
    if getattr(process.current_process(), "_inheriting", False):   # what multiprocessing itself checks
        sys.stderr.write(f"eagle-ray: {MAIN_GUARD}\n")
        sys.stderr.flush()
        os._exit(MAIN_GUARD_EXIT)


START_S = 120.0   # the least time a rank's process gets to start (import torch and the script) on a busy host


def wait_for_ranks(procs: list, pipes: list, timeout_s: float) -> None:
    """Rank 0: each rank's hello, sent once it has started (its process up, the script imported); a rank whose
    process ends first fails at once, naming why. Starting may take longer than a collective may (``timeout_s``):
    a dead rank is seen at once anyway, so only a rank that hangs while starting waits out ``START_S``."""
    timeout_s = max(timeout_s, START_S)
    from multiprocessing.connection import wait
    waiting = dict(enumerate(zip(procs, pipes), 1))
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        ready = wait([x for proc, pipe in waiting.values() for x in (pipe, proc.sentinel)], max(left, 0))
        if not ready:
            raise EngineDeadError(f"tensor-parallel ranks {sorted(waiting)} did not start within {timeout_s:.0f} s")
        for r, (proc, pipe) in list(waiting.items()):
            if pipe in ready:
                try:
                    pipe.recv()
                except (EOFError, OSError):
                    ready.append(proc.sentinel)   # it closed its end: read its exit below
                else:
                    del waiting[r]
                    continue
            if proc.sentinel in ready:
                proc.join(5)
                if proc.exitcode == MAIN_GUARD_EXIT:
                    raise NoMainGuard(MAIN_GUARD)
                raise EngineDeadError(f"tensor-parallel rank {r} (pid {proc.pid}) exited with code {proc.exitcode} "
                                      "before it joined; its output above says why")


# what every rank imports before it loads its shard: the fork server imports it once, then each rank starts as a fork
# of it (a spawned interpreter would import torch and transformers again for every rank of every start)
RANK_PRELOAD = ["eagle_ray.model.tensor_parallel", "eagle_ray.model.target", "eagle_ray.model.decoder"]


def rank_context():
    """multiprocessing's fork server, preloaded: ranks start as forks of a process that has imported what they need
    and has run nothing (no thread pools, no device), and like spawned ones they import the main script again. The
    server starts at the first ranks' start and keeps that moment's environment for every later one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def start_ranks(spec: Spec, world: int, make_target, timeout_s: float) -> Group:
    """Ranks 1..N-1 started (each loads its shard and follows) and rank 0's side of a new group."""
    check_not_spawning()
    if called_from_unguarded_main():
        raise NoMainGuard(MAIN_GUARD)
    device = torch.device(spec.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    port = free_port()
    ctx = rank_context()
    procs, pipes = [], []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=follow, args=(spec, rank, world, port, backend, timeout_s, theirs, make_target),
                           daemon=True, name=f"eagle-ray-tp-rank{rank}")
        proc.start()
        procs.append(proc)
        pipes.append(ours)
    try:
        wait_for_ranks(procs, pipes, timeout_s)
        group = Group(0, world, "127.0.0.1", port, backend, timeout_s)
    except (EngineDeadError, NoMainGuard):
        for p in procs:
            p.kill()
        raise
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
        pipe.send(("started",))   # rank 0 waits for this before it opens the group (wait_for_ranks)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank if device.index is None else device.index + rank)
            torch.cuda.set_device(device)
        row_sum = RowSum(Group(rank, world, "127.0.0.1", port, backend, timeout_s))
        hf = load_shard(spec.path, spec.config, getattr(torch, spec.dtype), device, rank, world, row_sum)
        target = make_target(hf, spec.max_slots, spec.max_len, row_sum=row_sum, **spec.precision)
        with torch.inference_mode():
            while True:
                try:
                    call = pipe.recv()
                except EOFError:   # rank 0 is gone
                    return
                if isinstance(call, Stop):
                    return
                call.run(target)
    except Exception:   # noqa: BLE001 - whatever it was, rank 0's next collective fails and names this rank
        traceback.print_exc()
        os._exit(1)




# ---- the calls rank 0 sends: each runs on a follower's own target ----------------------------------------------
def on_host(x):
    """``x`` with its tensors (inside lists and tuples too) copied to the host, to travel through a pipe."""
    if torch.is_tensor(x):
        return x.cpu() if x.device.type != "cpu" else x
    if isinstance(x, (list, tuple)):
        return type(x)(on_host(v) for v in x)
    return x


class Call:
    """A call rank 0 sends to the other ranks: ``run`` does the same on their shard."""

    def run(self, target) -> None:
        raise NotImplementedError


@dataclass
class Stop(Call):
    """Rank 0 closes the group: the follower returns."""


@dataclass
class Forward(Call):
    tokens: torch.Tensor
    slots: list
    lengths: object        # the slots' committed lengths at rank 0, which the follower takes first
    depth: torch.Tensor
    block_mask: torch.Tensor
    n_valid: list | None
    capture: tuple | None
    graphed: bool

    def run(self, target) -> None:
        target.cache.lengths[self.slots] = self.lengths
        target.forward(self.tokens, self.slots, self.depth, self.block_mask, n_valid=self.n_valid,
                       capture=self.capture, graphed=self.graphed)


@dataclass
class ForwardParts(Call):
    blocks: list           # (tokens, slots, lengths, depth, block_mask, n_valid) per block
    capture: tuple | None

    def run(self, target) -> None:
        for _, slots, lengths, *_ in self.blocks:
            target.cache.lengths[slots] = lengths
        target.forward_parts([(t, s, d, m, n) for t, s, _, d, m, n in self.blocks], self.capture)


@dataclass
class KeepAccepted(Call):
    slots: list
    src: torch.Tensor
    dst: torch.Tensor

    def run(self, target) -> None:
        target.cache.keep_accepted(self.slots, self.src, self.dst)


@dataclass
class Move(Call):
    src: int
    dst: int
    n: int

    def run(self, target) -> None:
        target.cache.lengths[self.src] = self.n
        target.cache.move(self.src, self.dst)


@dataclass
class CopyPrefix(Call):
    src: int
    dst: int
    n: int

    def run(self, target) -> None:
        target.cache.copy_prefix(self.src, self.dst, self.n)


# ---- what the engine holds --------------------------------------------------------------------------------------
class Delegate:
    """Reads and writes of what a wrapper does not define itself go to the object it wraps (``inner``)."""
    _own = ("inner",)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "inner"), name)

    def __setattr__(self, name, value):
        if name in type(self)._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)


class ShardedCache(Delegate):
    """Rank 0's KV cache: each K/V move goes to the other ranks first, then runs on rank 0's heads."""
    _own = ("inner", "row_sum")

    def __init__(self, cache, row_sum: RowSum):
        self.inner, self.row_sum = cache, row_sum

    @property
    def group(self) -> Group:
        return self.row_sum.group   # the target's, restarted or not

    def keep_accepted(self, slots: list[int], src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.send(KeepAccepted(slots, src, dst))
        self.inner.keep_accepted(slots, src, dst)

    def move(self, src: int, dst: int) -> None:
        self.group.send(Move(src, dst, int(self.inner.lengths[src])))
        self.inner.move(src, dst)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.group.send(CopyPrefix(src, dst, n))
        self.inner.copy_prefix(src, dst, n)


class ShardedTarget(Delegate):
    """A target split over ranks, as the engine holds it: rank 0's shard (``inner``, a ``TargetModel``) whose
    calls that touch the shards reach every rank. ``tp``: the group (its ranks' processes in ``tp.procs``)."""
    _own = ("inner", "row_sum", "cache")

    def __init__(self, shard, row_sum: RowSum):
        self.inner, self.row_sum = shard, row_sum
        self.cache = ShardedCache(shard.cache, row_sum)

    @property
    def tp(self) -> Group:
        return self.row_sum.group

    def forward(self, tokens: torch.Tensor, slots: list[int], depth: torch.Tensor, block_mask: torch.Tensor,
                n_valid: list[int] | None = None, capture: tuple[int, ...] | None = None, graphed: bool = True):
        self.tp.send(Forward(tokens, slots, self.inner.cache.lengths[slots].copy(), depth, block_mask, n_valid,
                             capture, graphed))
        return self.inner.forward(tokens, slots, depth, block_mask, n_valid, capture, graphed)

    def forward_parts(self, blocks, capture: tuple[int, ...] | None = None, graphed: bool = True) -> list:
        if len(blocks) == 1:   # one block is a forward (as the shard runs it)
            return [self.forward(*blocks[0], capture, graphed)]
        lengths = self.inner.cache.lengths
        self.tp.send(ForwardParts([(t, s, lengths[s].copy(), d, m, n) for t, s, d, m, n in blocks], capture))
        return self.inner.forward_parts(blocks, capture, graphed)

    def next_token_logits(self, ids: list[int], slot: int = 0) -> torch.Tensor:
        return type(self.inner).next_token_logits(self, ids, slot)   # its forward through this one

    def restart(self) -> None:
        """The other ranks stopped and started again in a new group (their state, or their process, is in doubt
        after a failed step); rank 0's shard stays loaded, its cache emptied."""
        self.row_sum.group = self.tp.restarted()
        self.inner.restart()

    def close(self) -> None:
        """Stop the other ranks."""
        self.tp.close()
