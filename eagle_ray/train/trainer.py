"""Drafter training on extracted features: EAGLE-1/2 heads here, EAGLE-3 heads with ``eagle_ray.train.eagle3``.

Recipe (Li et al.; SafeAILab e2): the head sees (feature f_i, token x_{i+1}) and regresses f_{i+1} with SmoothL1,
plus 0.1 x soft cross-entropy between lm_head(prediction) and the target's distribution lm_head(f_{i+1}) (the
target's lm_head, frozen); uniform noise on the input features; AdamW(0.9, 0.95), linear warmup, gradient clipping.
Only assistant positions count. ``unroll_steps > 1`` adds the losses of the head run on its own predicted
features, as the deeper levels of a draft tree run it (HASS / EAGLE-3's training-time test). Resumable: the
checkpoint holds head, optimizer, step and the data position, and every random draw is seeded from (seed, step),
so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle_ray.errors import CheckpointError
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.train.records import differences
from eagle_ray.train.unrolled import unrolled_attention


@dataclass
class TrainConfig:
    lr: float = 3e-4
    warmup_steps: int = 200
    epochs: int = 4
    tokens_per_step: int = 2048
    max_len: int = 1024
    grad_clip: float = 0.5
    noise: float = 0.2
    ce_weight: float = 0.1
    ce_fraction: float = 1.0   # fraction of positions that pay the lm_head cross-entropy (saves CPU time)
    seed: int = 0
    eval_fraction: float = 0.02
    checkpoint_every: int = 100
    autocast_bf16: bool = False
    ce_on_token_map: bool = True   # with a draft vocabulary, the cross-entropy runs over it alone (see losses)
    unroll_steps: int = 1          # >1: also train on the head's own predicted features (see head_forward_unrolled)
    unroll_weight: float = 1.0     # loss weight of each unrolled step relative to the one before it
    eval_steps: int = 3            # held-out top-1 is reported for this many unrolled steps
    repeat_keep: float = 1.0       # <1: score only this share of the tokens that repeat an earlier n-gram (loops)
    repeat_ngram: int = 32         # the n of repeat_keep (data.repeated_tokens)
    device: str = "cpu"            # where the head trains; the conversations' tensors may live there too
    time_budget_s: float = 0.0     # >0: fit the schedule to this many seconds of training (see train)

    def __post_init__(self):
        """A value no run can use fails here, naming the field, instead of deep in the first step."""
        rules = {"lr": self.lr > 0, "warmup_steps": self.warmup_steps >= 1, "epochs": self.epochs >= 1,
                 "tokens_per_step": self.tokens_per_step >= 1, "max_len": self.max_len >= 2,
                 "grad_clip": self.grad_clip > 0, "noise": self.noise >= 0, "ce_weight": self.ce_weight >= 0,
                 "ce_fraction": 0 < self.ce_fraction <= 1, "eval_fraction": 0 <= self.eval_fraction < 1,
                 "checkpoint_every": self.checkpoint_every >= 1, "unroll_steps": self.unroll_steps >= 1,
                 "unroll_weight": self.unroll_weight > 0, "eval_steps": self.eval_steps >= 1,
                 "repeat_keep": 0 < self.repeat_keep <= 1, "repeat_ngram": self.repeat_ngram >= 1,
                 "time_budget_s": self.time_budget_s >= 0}
        bad = [f"{k}={getattr(self, k)!r}" for k, ok in rules.items() if not ok]
        if bad:
            raise ValueError(f"invalid training settings: {', '.join(bad)} (rates and counts must be positive; "
                             "ce_fraction in (0, 1], eval_fraction in [0, 1), repeat_keep in (0, 1])")

    def identity(self) -> dict:
        """The settings a resumed run must share with the run that wrote its checkpoint (where the head trains and
        the time budget, refitted from each start's clock, may change)."""
        return {k: v for k, v in asdict(self).items() if k not in ("device", "time_budget_s")}


def make_batches(lengths: list[int], tokens_per_step: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of conversation indices, shuffled deterministically per epoch."""
    rng = random.Random(seed * 1000003 + epoch)
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        longest_new = max(longest, lengths[i])
        if cur and longest_new * (len(cur) + 1) > tokens_per_step:
            batches.append(cur)
            cur, longest_new = [], lengths[i]
        cur.append(i)
        longest = longest_new
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(convs: list[dict], idx: list[int], max_len: int):
    """Pad a batch: inputs (h[0..n-1), x[1..n)), targets h[1..n), mask on assistant target positions."""
    n = min(max(len(convs[i]["input_ids"]) for i in idx), max_len)
    B, d, dev = len(idx), convs[idx[0]]["hidden"].shape[-1], convs[idx[0]]["hidden"].device
    tokens = torch.zeros(B, n - 1, dtype=torch.long, device=dev)
    feats = torch.zeros(B, n - 1, d, device=dev)
    target = torch.zeros(B, n - 1, d, device=dev)
    mask = torch.zeros(B, n - 1, device=dev)
    for b, i in enumerate(idx):
        c = convs[i]
        m = min(len(c["input_ids"]), n)
        tokens[b, : m - 1] = c["input_ids"][1:m]
        feats[b, : m - 1] = c["hidden"][: m - 1].float()
        target[b, : m - 1] = c["hidden"][1:m].float()
        mask[b, : m - 1] = c["loss_mask"][1:m].float()
    return tokens, feats, target, mask


def head_forward_unrolled(head: DraftHead, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list:
    """The head as its draft tree runs it, ``steps`` levels deep, for every position at once.

    Step 0 is :func:`head_forward_train` (true features). Beyond the root, the draft feeds the head its *own*
    prediction: step ``s`` at position ``i`` takes the feature step ``s-1`` predicted at ``i-1`` and attends to the
    true-feature keys up to ``i-s`` plus the keys its own chain made at ``i-s+1 .. i`` (the draft cache's view).
    Training on these steps too (HASS; EAGLE-3's "training-time test") teaches the deeper tree levels to work
    from predicted features. Predictions fed forward are detached. Returns the predictions of each step.
    """
    B, T = tokens.shape
    emb = head.embed_tokens(tokens)
    pos = torch.arange(T, device=tokens.device).unsqueeze(0).expand(B, T)
    layer = head.layers[0]
    attn = layer.self_attn
    keys, values, preds, inp = [], [], [], feats
    for s in range(steps):
        x = head.fc(torch.cat([emb, inp.to(emb.dtype)], dim=-1))
        if s == 0:
            cos, sin = head.rotary_emb(x, pos)  # in x's dtype (bf16 under autocast), like q and k
        h = x + unrolled_attention(attn, x, s, keys, values, cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        preds.append(h)
        inp = torch.cat([feats[:, :1], h[:, :-1].detach().to(feats.dtype)], dim=1)
    return preds


def head_forward_train(head: DraftHead, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Full-sequence causal forward of the head on true features (training path, plain attention, no cache)."""
    return head_forward_unrolled(head, tokens, feats, 1)[0]


def losses(head: DraftHead, lm_weight: torch.Tensor, tokens, feats, target, mask, cfg: TrainConfig,
           gen: torch.Generator | None, train: bool, vocab: torch.Tensor | None = None, steps: int | None = None):
    """Feature loss, soft cross-entropy, top-1 accuracy against the target's argmax, the positions scored, and per
    unrolled step (``steps``, default ``cfg.unroll_steps``; see :func:`head_forward_unrolled`) its top-1, feature
    loss and count.

    The losses are the steps' losses weighted ``1, w, w^2, ...`` (``cfg.unroll_weight``); accuracy and count are
    step 0's. With ``vocab`` (the draft vocabulary, as the engine binds it) both distributions are taken over those
    ids alone, the target's renormalised there, as EAGLE-3 trains its reduced-vocabulary heads: the head learns
    exactly the choice it makes at inference, for a sixth of the lm_head cost with an 8k map. Accuracy then counts
    a target argmax outside the map as a miss (exact in evaluation; training logs compare inside the map)."""
    steps = steps or cfg.unroll_steps
    if train and cfg.noise > 0:
        noise = (torch.rand(feats.shape, generator=gen, device=feats.device) - 0.5) * cfg.noise * 512 / feats.shape[1]
        feats = feats + noise
    with torch.autocast(feats.device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
        preds = head_forward_unrolled(head, tokens, feats, steps)
    sel = mask.bool()
    if train and cfg.ce_fraction < 1.0:
        sel = sel & (torch.rand(mask.shape, generator=gen, device=mask.device) < cfg.ce_fraction)
    w = lm_weight if vocab is None else lm_weight[vocab]
    with torch.no_grad():
        t_all = target[sel]
        if vocab is None or train:
            t_logits = t_all @ w.T
            t_top = t_logits.argmax(-1) if vocab is None else vocab[t_logits.argmax(-1)]
        else:  # evaluation scores the target's true argmax: one full product, the map's columns taken from it
            full = t_all @ lm_weight.T
            t_logits, t_top = full[:, vocab], full.argmax(-1)
        t_prob = t_logits.softmax(-1)
    vloss, ploss, steps_out = 0.0, 0.0, []
    for s, pred in enumerate(preds):
        pred = pred.float()
        m = mask.clone()
        m[:, :s] = 0  # step s needs s predicted features before it
        denom = m.sum().clamp(min=1)
        keep = m[sel].bool()  # the scored positions this step still has
        p_logits = pred[sel][keep] @ w.T
        weight = cfg.unroll_weight ** s
        if keep.any():
            ploss = ploss - weight * (t_prob[keep] * p_logits.log_softmax(-1)).sum(-1).mean()
        p_top = p_logits.argmax(-1) if vocab is None else vocab[p_logits.argmax(-1)]
        step_v = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * m).sum() / denom
        vloss = vloss + weight * step_v
        top1 = (p_top == t_top[keep]).float().mean().item() if keep.any() else 0.0
        steps_out.append({"top1": top1, "vloss": step_v.item(), "scored": int(keep.sum())})
    acc, n0 = steps_out[0]["top1"], steps_out[0]["scored"]
    if not torch.is_tensor(ploss):
        ploss = preds[0].sum() * 0
    return vloss, ploss, acc, n0, steps_out


def batch_losses(head, lm_weight, convs, idx, cfg: TrainConfig, gen, train: bool, vocab=None, steps=None):
    """(loss, feature loss, CE loss, top-1, scored, per step) of a batch, for either head kind: an EAGLE-1/2 head
    regresses features plus ``ce_weight`` x CE; an EAGLE-3 head has the CE alone (``eagle_ray.train.eagle3``)."""
    if getattr(head, "kind", "eagle2") == "eagle3":
        from eagle_ray.train import eagle3
        batch = [t.to(cfg.device) for t in eagle3.collate(convs, idx, cfg.max_len)]
        v, p, acc, n, per = eagle3.losses(head, lm_weight, batch, cfg, gen, train, steps)
        return v + p, v, p, acc, n, per
    batch = [t.to(cfg.device) for t in collate(convs, idx, cfg.max_len)]
    v, p, acc, n, per = losses(head, lm_weight, *batch, cfg, gen, train, vocab, steps)
    return v + cfg.ce_weight * p, v, p, acc, n, per


def widen_mlp(head: DraftHead, intermediate_size: int, seed: int = 0) -> DraftHead:
    """A copy of an EAGLE-1/2 ``head`` whose MLP has ``intermediate_size`` units, computing the same function: the
    new units' gate and up rows start small and random, their ``down_proj`` columns at zero, so training grows
    them from the trained head's behaviour instead of from scratch."""
    old = head.layers[0].mlp
    n = old.gate_proj.out_features
    if intermediate_size < n:
        raise ValueError(f"intermediate_size {intermediate_size} is below the head's {n}")
    cfg = type(head.config)(**{**head.config.to_dict(), "intermediate_size": intermediate_size})
    wide = type(head)(cfg, bias=head.bias, qkv_bias=head.qkv_bias)
    state = dict(head.state_dict())
    gen = torch.Generator().manual_seed(seed)
    d = old.gate_proj.in_features
    for name in ("gate_proj", "up_proj"):
        w = state[f"layers.0.mlp.{name}.weight"]
        extra = torch.randn(intermediate_size - n, d, generator=gen, dtype=w.dtype) * w.float().std().to(w.dtype)
        state[f"layers.0.mlp.{name}.weight"] = torch.cat([w, extra])
    down = state["layers.0.mlp.down_proj.weight"]
    state["layers.0.mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], intermediate_size - n)],
                                                       dim=1)
    wide.load_state_dict(state)
    wide.token_map = head.token_map
    return wide.to(head.fc.weight.dtype)


def save_checkpoint(path: Path, head, opt, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
    os.replace(tmp, path)


class TrainingDataError(ValueError):
    """The data leaves nothing to train on: a one-line exit for the command line, not a traceback."""


def content_key(conv: dict) -> bytes:
    """A conversation's tokens and scored positions: two sources may hold the same text under different ids."""
    return conv["input_ids"].cpu().numpy().tobytes() + conv["loss_mask"].cpu().bool().numpy().tobytes()


def split_held_out(convs: list[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(held-out, training): the first ``eval_fraction`` of ``convs`` (at least one where there are two or more),
    and the rest less any conversation equal to a held-out one, so held-out accuracy is never measured on text the
    head trained on."""
    n_eval = max(1, int(len(convs) * eval_fraction)) if len(convs) > 1 else 0
    held_out = convs[:n_eval]
    seen = {content_key(c) for c in held_out}
    lengths = {len(c["input_ids"]) for c in held_out}   # only a conversation of a held-out length is read back
    return held_out, [c for c in convs[n_eval:] if len(c["input_ids"]) not in lengths or content_key(c) not in seen]


def run_identity(convs: list[dict], head, cfg: TrainConfig, vocab: torch.Tensor | None, run: dict | None) -> dict:
    """What a checkpoint's run was: its settings, its data (count, tokens, a content digest), the head's kind and
    shapes, the draft vocabulary, and ``run`` (the caller's own: target, start point, sources)."""
    import hashlib
    digest = hashlib.sha256(str([len(c["input_ids"]) for c in convs]).encode())
    if convs:   # one read-back of every token and scored position, wherever the conversations live
        digest.update(torch.cat([c["input_ids"].view(-1).long() for c in convs]).cpu().numpy().tobytes())
        digest.update(torch.cat([c["loss_mask"].view(-1).bool() for c in convs]).cpu().numpy().tobytes())
    return {"settings": cfg.identity(), "conversations": len(convs),
            "tokens": sum(len(c["input_ids"]) for c in convs), "data_sha256": digest.hexdigest()[:16],
            "head": f"{getattr(head, 'kind', 'eagle2')} " + " ".join(
                f"{k}:{tuple(v.shape)}" for k, v in head.state_dict().items() if k != "embed_tokens.weight"),
            "draft_vocab": None if vocab is None else hashlib.sha256(
                vocab.cpu().numpy().astype("int64").tobytes()).hexdigest()[:16],
            **(run or {})}


def load_checkpoint(ckpt: Path, device, identity: dict) -> dict:
    """The saved run, refused (naming what differs) unless it is the run now asked for: resuming someone else's
    checkpoint would train on with other data or settings and write a card describing a run that never was."""
    try:
        saved = torch.load(ckpt, weights_only=True, map_location=device)
        state = saved["state"]
    except Exception as e:  # noqa: BLE001  (torch raises several types for a damaged file)
        raise CheckpointError(f"training checkpoint {ckpt} cannot be read ({type(e).__name__}: {e}); delete it to "
                              "start this run afresh") from None
    before = state.get("run")
    if before is not None and before != identity:
        raise CheckpointError(f"{ckpt} belongs to another run ({'; '.join(differences(before, identity))}): resume "
                              "with the same data and flags, or use another --out")
    return saved


def train(convs: list[dict], head: DraftHead, lm_weight: torch.Tensor, out_dir: str | Path, cfg: TrainConfig,
          max_steps: int | None = None, log=print, vocab: torch.Tensor | None = None, clock=time.time,
          run: dict | None = None) -> dict:
    """Train ``head`` in place (on ``cfg.device``); resumes from ``out_dir/checkpoint.pt`` when present, if that
    checkpoint was written by the same run (settings, data, head shapes, draft vocabulary and ``run``, the
    caller's description: see ``run_identity``). Returns the final metrics. ``vocab``: the draft vocabulary the
    head will be served with (the cross-entropy's ids, see ``losses``).

    The schedule runs ``cfg.epochs`` epochs. With ``cfg.time_budget_s`` it is fitted to that many seconds instead
    (at most ``cfg.epochs``): twenty steps from the tenth on are timed, the total is set from their pace (less a
    margin for the held-out evaluations; the budget counts this process's time) and kept in the checkpoint, so a
    resumed run follows the same schedule. A run cut short that way ends mid-epoch, evaluated like an epoch's
    end."""
    vocab = vocab.to(cfg.device) if vocab is not None and cfg.ce_on_token_map else None
    head.to(cfg.device)
    lm_weight = lm_weight.to(cfg.device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eval_set, train_set = training_sets(convs, cfg, log)
    identity = run_identity(convs, head, cfg, vocab, run)
    lengths = [min(len(c["input_ids"]), cfg.max_len) for c in train_set]
    head.embed_tokens.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = len(make_batches(lengths, cfg.tokens_per_step, cfg.seed, 0))
    state = {"step": 0, "epoch": 0, "batch": 0, "history": [], "run": identity}
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        saved = load_checkpoint(ckpt, cfg.device, identity)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        state = {**saved["state"], "run": identity}
        log(f"resumed at step {state['step']} (epoch {state['epoch']}, batch {state['batch']})")
    total = state.get("total") or steps_per_epoch * cfg.epochs
    sched = lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa
    t0, t_log, seen, timed_from = clock(), time.time(), 0, None  # (step, clock) the budget's pace is timed from
    while state["step"] < total:
        batches = make_batches(lengths, cfg.tokens_per_step, cfg.seed, state["epoch"])
        while state["batch"] < len(batches) and state["step"] < total:
            if max_steps is not None and state["step"] >= max_steps:
                return state
            if cfg.time_budget_s > 0 and "total" not in state and state["step"] >= 10:
                total, timed_from = fit_to_budget(state, cfg, clock(), t0, timed_from, total, steps_per_epoch,
                                                  len(eval_set), log)
            vloss, ploss, acc, scored = train_step(head, opt, params, lm_weight, train_set, batches[state["batch"]],
                                                   cfg, state["step"], sched(state["step"]), vocab)
            state["step"] += 1
            state["batch"] += 1
            seen += scored
            if state["step"] % 20 == 0:
                log(f"step {state['step']}/{total} epoch {state['epoch']} vloss {vloss.item():.4f} "
                    f"ploss {ploss.item():.3f} acc {acc:.3f} {seen / (time.time() - t_log):.0f} tok/s")
            if state["step"] % cfg.checkpoint_every == 0:
                save_checkpoint(ckpt, head, opt, state)
        metrics = evaluate(head, lm_weight, eval_set, cfg, vocab=vocab) if eval_set else {}
        metrics.update(epoch=state["epoch"], step=state["step"])
        state["history"].append(metrics)
        log(f"epoch {state['epoch']} done: {json.dumps(metrics)}")
        if state["batch"] >= len(batches):
            state["epoch"] += 1
            state["batch"] = 0
        save_checkpoint(ckpt, head, opt, state)
    state["finished"] = True
    return state


def training_sets(convs: list[dict], cfg: TrainConfig, log) -> tuple[list[dict], list[dict]]:
    """(held-out, training) conversations; a training conversation equal to a held-out one is left out, and with
    ``repeat_keep`` < 1 the training set's repeated tokens are thinned (held-out scoring stays on every token)."""
    eval_set, train_set = split_held_out(convs, cfg.eval_fraction)
    if not train_set:
        raise TrainingDataError(f"no conversations to train on ({len(convs)} given, {len(eval_set)} of them held "
                                "out)")
    if len(train_set) + len(eval_set) < len(convs):
        log(f"{len(convs) - len(train_set) - len(eval_set)} training conversations equal a held-out one: left out")
    if cfg.repeat_keep < 1.0:  # held-out scoring stays on every token
        from eagle_ray.train.data import thin_repeats
        train_set = [{**c, "loss_mask": thin_repeats(c["input_ids"], c["loss_mask"], cfg.repeat_keep, cfg.repeat_ngram,
                                                     cfg.seed)} for c in train_set]
    return eval_set, train_set


def fit_to_budget(state: dict, cfg: TrainConfig, now: float, t0: float, timed_from, total: int,
                  steps_per_epoch: int, n_eval: int, log):
    """Once twenty steps from ``timed_from`` are timed (or the schedule is about to end), the schedule's total is
    set from their pace so training ends within ``cfg.time_budget_s``, less room for the held-out evaluations; kept
    in ``state`` so a resumed run follows it. Returns (total, timed_from)."""
    timed_from = timed_from or (state["step"], now)
    first, t_first = timed_from
    if state["step"] == first + 20 or (state["step"] > first and state["step"] == total - 1):
        pace = (now - t_first) / (state["step"] - first)
        left = cfg.time_budget_s * 0.95 - (now - t0)
        evals = 1 + min(cfg.epochs, math.ceil(left / (pace * steps_per_epoch)))
        left -= evals * evaluation_cost(pace, n_eval)
        state["total"] = total = min(total, state["step"] + max(1, int(left / pace)))
        log(f"time budget {cfg.time_budget_s:.0f} s: {pace * 1e3:.1f} ms a step, {total} steps "
            f"({total / steps_per_epoch:.2f} epochs)")
    return total, timed_from


def train_step(head: DraftHead, opt, params: list, lm_weight: torch.Tensor, train_set: list[dict], batch: list[int],
               cfg: TrainConfig, step: int, lr_scale: float, vocab: torch.Tensor | None):
    """One optimiser step on ``batch``, its random draws seeded from (seed, step) so a resumed run repeats them.
    Returns (vloss, ploss, top-1, scored tokens)."""
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed * 7919 + step)
    for g in opt.param_groups:
        g["lr"] = cfg.lr * lr_scale
    head.train()
    loss, vloss, ploss, acc, scored, _ = batch_losses(head, lm_weight, train_set, batch, cfg, gen, True, vocab)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_value_(params, cfg.grad_clip)
    opt.step()
    return vloss, ploss, acc, scored


def evaluation_cost(step_s: float, n_eval: int) -> float:
    """Rough seconds of one held-out evaluation, which a fitted schedule leaves room for at each epoch's end: a
    conversation (forwards only, one at a time) costs up to half a training step where kernel launches dominate,
    as on a GPU with a head this small."""
    return n_eval * step_s / 2


@torch.no_grad()
def evaluate(head: DraftHead, lm_weight: torch.Tensor, convs: list[dict], cfg: TrainConfig, depth: int = 5,
             vocab: torch.Tensor | None = None) -> dict:
    """Held-out top-1 accuracy against the target's argmax (per unrolled step in ``eval_top1_by_step``: step s
    drafts from s predicted features, as tree level s does), and the chain acceptance length step 0 implies
    (``sum_j acc^j`` for j = 0..depth: a simulation that assumes deeper steps are as accurate as the first)."""
    head.eval()
    steps = max(cfg.eval_steps, 1)
    tot_v, tot_acc, n = 0.0, [0.0] * steps, [0] * steps
    for i in range(len(convs)):
        per_step = batch_losses(head, lm_weight, convs, [i], cfg, None, False, vocab, steps)[5]
        tot_v += per_step[0]["vloss"] * per_step[0]["scored"]
        for s, st in enumerate(per_step):
            tot_acc[s] += st["top1"] * st["scored"]
            n[s] += st["scored"]
    by_step = [a / max(c, 1) for a, c in zip(tot_acc, n)]
    acc = by_step[0]
    return {"eval_vloss": tot_v / max(n[0], 1), "eval_top1": acc, "eval_top1_by_step": by_step,
            "sim_tau_chain": sum(acc ** j for j in range(depth + 1)), "eval_tokens": n[0]}


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)
