"""Online adaptation: the head learns the job it runs, while the output stays the target's own.

Every verify pass computes what EAGLE training needs: the target's features at the accepted positions and the
tokens, which the engine already hands the head as (feature f_i, token x_{i+1}) pairs. Kept per sequence until it
finishes, they become a training conversation (the target's own output, in the job's domain). A candidate copy of
the head trains on them in slices between engine steps, within ``time_share`` of the engine's time, with the
project's losses (``train/trainer.py``); every ``round_steps`` steps it is scored (top-1 draft accuracy) against the
live head on sequences held back from training, and replaces the live head's weights between two steps only if it
beats them by ``min_gain``. A candidate that scores below the live head is discarded and a new copy starts from
the live head; one that is level or ahead by less than the held-back set can tell trains on (one round's steps
rarely win alone; thrown away each round, their progress would never add up). Verification decides every token,
so no head, good or bad, changes what is generated: a worse head would only cost acceptance, and the score keeps
it out.

An EAGLE-2 head regresses the next pair's feature (plus the cross-entropy); an EAGLE-3 head's pairs carry the
target's fused states, not its final ones, so it learns the emitted token (``eagle3.collate``): a sample of
the target's distribution, and in greedy decoding its argmax, which is what EAGLE-3's training scores.
"""
from __future__ import annotations

import copy
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_ray.config import AdaptationConfig

MIN_SCORED = 64   # held-back positions a score needs before any swap
log = logging.getLogger(__name__)


@dataclass
class Swap:
    """One replacement of the live head: when, on how much data, and the held-back scores either side."""
    version: int
    pairs_seen: int
    sequences_seen: int
    live_top1: float
    candidate_top1: float


@dataclass
class AdaptationState:
    version: int = 0                 # the live head's version: 0 is the head the engine loaded
    pairs_seen: int = 0
    sequences_seen: int = 0
    train_steps: int = 0
    rounds: int = 0
    engine_s: float = 0.0
    train_s: float = 0.0
    swaps: list[Swap] = field(default_factory=list)
    rejected: int = 0                # candidates discarded: they scored below the live head
    trained_on: int = 0              # rounds a candidate neither won nor lost, and kept training
    saved_version: int | None = None  # the last version written by ``on_swap`` (the job's adapted-head folder)
    save_failures: int = 0           # swaps whose head could not be written: the next swap writes again


class Adapter:
    def __init__(self, head, lm_weight: torch.Tensor, cfg: AdaptationConfig):
        from eagle_ray.train.trainer import TrainConfig
        self.live, self.cfg = head, cfg
        self.eagle3 = getattr(head, "kind", "eagle2") == "eagle3"
        self.device = head.fc.weight.device
        self.lm_weight = lm_weight.detach().float()
        self.vocab = getattr(head, "token_map", None)
        self.train_cfg = TrainConfig(lr=cfg.lr, warmup_steps=1, tokens_per_step=cfg.batch_tokens, max_len=1024,
                                     noise=0.2, unroll_steps=1, device=str(self.device))
        self.train_set: deque[dict] = deque()
        self.held_back: deque[dict] = deque()
        self.train_pairs = self.held_pairs = 0
        self.state = AdaptationState()
        self.candidate = self.opt = None
        self.round_steps = 0
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.tau_by_version: dict[int, list] = {}   # [tau sum, sequences] of each head version's finished sequences
        self.on_swap = None   # called after each swap (the job's actor writes the adapted head)

    # ---- data --------------------------------------------------------------------------------------------------
    def add(self, seq) -> None:
        """A finished sequence's pairs (``PendingPairs.kept``) as a conversation: the pairs whose next token is an
        output token are scored (as training scores assistant positions only)."""
        kept, seq.pending.kept = seq.pending.kept, None
        if seq.stats.verify_steps:
            tv = self.tau_by_version.setdefault(self.state.version, [0.0, 0])
            tv[0] += seq.stats.tau
            tv[1] += 1
        if not kept:
            return
        tokens = [t for toks, _ in kept for t in toks]
        n = min(len(tokens), sum(f.shape[0] for _, f in kept))
        if n < 3:
            return
        prompt = len(seq.prompt_ids)
        with torch.inference_mode(False):   # tensors autograd may save (the step made its own in inference mode)
            feats = torch.cat([f for _, f in kept])[:n].float().clone()
            # pair i is (f_i, x_{i+1}); a conversation of n positions pairs hidden[i] with input_ids[i + 1]
            conv = {"input_ids": torch.tensor([0] + tokens[: n - 1]),
                    "loss_mask": (torch.arange(n) >= prompt).to(torch.long)}
            if self.eagle3:   # fused states, and the token after x_{i+1} as position i's label
                conv |= {"aux": feats, "labels": torch.tensor(tokens[1:n])}
            else:
                conv["hidden"] = feats
        if not conv["loss_mask"][1:].any():
            return
        self.state.sequences_seen += 1
        self.state.pairs_seen += n
        if self.state.sequences_seen % self.cfg.hold_back == 0:
            self.held_back.append(conv)
            self.held_pairs += n
            while self.held_pairs > self.cfg.buffer_tokens // 4 and len(self.held_back) > 1:
                self.held_pairs -= len(self.held_back.popleft()["input_ids"])
        else:
            self.train_set.append(conv)
            self.train_pairs += n
            while self.train_pairs > self.cfg.buffer_tokens and len(self.train_set) > 1:
                self.train_pairs -= len(self.train_set.popleft()["input_ids"])

    def buffered_pairs(self) -> int:
        return self.train_pairs + self.held_pairs

    # ---- training slices ---------------------------------------------------------------------------------------
    def after_step(self, step_s: float) -> bool:
        """Account ``step_s`` of engine time and, within the time share, run one training step (and, at the end of
        a round, score and maybe swap). Returns True when the live head changed."""
        st = self.state
        st.engine_s += step_s
        if not self.train_set or not self.held_back or st.train_s > self.cfg.time_share * st.engine_s:
            return False
        t0 = time.perf_counter()
        try:
            with torch.inference_mode(False):   # the engine steps in inference mode; training needs autograd
                self.train_step()
                swapped = self.round_steps >= self.cfg.round_steps and self.score_round()
        finally:
            st.train_s += time.perf_counter() - t0
        return swapped

    def train_step(self) -> None:
        from eagle_ray.train.trainer import batch_losses
        if self.candidate is None:
            self.candidate = fresh_copy(self.live)
            params = [p for p in self.candidate.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
            self.round_steps = 0
        convs = list(self.train_set)
        order = torch.randperm(len(convs), generator=self.gen).tolist()
        idx, pairs = [], 0
        for i in order:
            idx.append(i)
            pairs += len(convs[i]["input_ids"])
            if pairs >= self.cfg.batch_tokens:
                break
        with torch.enable_grad():
            self.candidate.train()
            if self.eagle3:
                from eagle_ray.train import eagle3
                batch = eagle3.collate(convs, idx, self.train_cfg.max_len)
                v, p, *_ = eagle3.losses(self.candidate, None, batch, self.train_cfg, self.gen, True)
                loss = v + p
            else:
                loss, *_ = batch_losses(self.candidate, self.lm_weight, convs, idx, self.train_cfg, self.gen, True,
                                        self.vocab)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.candidate.parameters(), self.train_cfg.grad_clip)
            self.opt.step()
        self.round_steps += 1
        self.state.train_steps += 1

    def hits(self, head) -> torch.Tensor:
        """Per scored held-back position, whether ``head``'s top draft token is the target's next token."""
        from eagle_ray.train.trainer import collate, head_forward_train
        w = self.lm_weight if self.vocab is None else self.lm_weight[self.vocab]
        out = []
        with torch.no_grad():
            head.eval()
            if self.eagle3:
                return self._eagle3_hits(head)
            for conv in self.held_back:
                tokens, feats, target, mask = collate([conv], [0], self.train_cfg.max_len)
                sel = mask[0].bool()
                pred = head_forward_train(head, tokens, feats)[0][sel].float()
                top = (pred @ w.T).argmax(-1)
                top = top if self.vocab is None else self.vocab[top]
                out.append(top == (target[0][sel] @ self.lm_weight.T).argmax(-1))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)

    def _eagle3_hits(self, head) -> torch.Tensor:
        from eagle_ray.train import eagle3
        out = []
        for conv in self.held_back:
            tokens, feats, labels, mask = eagle3.collate([conv], [0], self.train_cfg.max_len)
            sel = mask[0].bool()
            pred = eagle3.unrolled(head, tokens, feats, 1)[0][0][sel]
            top = head.lm_head(head.norm(pred.to(head.lm_head.weight.dtype))).argmax(-1)
            out.append(head.draft_to_target[top] == labels[0][sel])
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)

    def score_round(self) -> bool:
        """Score the candidate against the live head on the same held-back positions; swap it in only if it wins
        by ``min_gain`` and by more than twice the paired difference's standard error (a gain the held-back set
        can tell from noise); discard it if it scores below the live head; else let it train another round."""
        st = self.state
        st.rounds += 1
        live, cand = self.hits(self.live).float(), self.hits(self.candidate).float()
        diff = cand - live
        n = diff.numel()
        gain = float(diff.mean()) if n else 0.0
        noise = 2 * float(diff.std()) / n ** 0.5 if n > 1 else float("inf")
        if n >= MIN_SCORED and gain >= self.cfg.min_gain and gain > noise:
            with torch.inference_mode():
                for mine, theirs in zip(self.live.parameters(), self.candidate.parameters()):
                    mine.copy_(theirs.detach().to(mine.dtype))
            st.version += 1
            st.swaps.append(Swap(st.version, st.pairs_seen, st.sequences_seen, round(float(live.mean()), 4),
                                 round(float(cand.mean()), 4)))
            self.round_steps = 0
            if self.on_swap is not None:
                try:
                    self.on_swap(self)
                    st.saved_version = st.version
                except Exception as e:  # noqa: BLE001 - a head that cannot be written costs its copy, never a row
                    st.save_failures += 1
                    log.warning("the adapted head (version %d) could not be written (%d failures so far; the next "
                                "swap writes it again): %s: %s", st.version, st.save_failures, type(e).__name__, e)
            return True
        if gain < 0:   # behind the live head: discarded, the next round starts from the live head
            st.rejected += 1
            self.candidate = self.opt = None
        else:          # level, or ahead by less than the held-back set can tell: it trains on, keeping its progress
            st.trained_on += 1
        return False

    def summary(self) -> dict:
        st = self.state
        return {"version": st.version, "sequences_seen": st.sequences_seen, "pairs_seen": st.pairs_seen,
                "train_steps": st.train_steps, "rounds": st.rounds, "rejected": st.rejected,
                "trained_on": st.trained_on, "saved_version": st.saved_version, "save_failures": st.save_failures,
                "time_share": round(st.train_s / st.engine_s, 4) if st.engine_s else 0.0,
                "buffered_pairs": self.buffered_pairs(),
                "tau_by_version": {v: round(t / n, 4) for v, (t, n) in sorted(self.tau_by_version.items()) if n},
                "swaps": [s.__dict__ for s in st.swaps]}

    def save(self, uri: str, storage_options: dict | None = None, base: str | None = None) -> None:
        """The live head (as loaded, with its adapted weights) and a model card to ``uri`` (a directory or an
        ``s3://`` prefix, resolved as the job resolves its output): what the next job can start from. The card
        goes last, so a folder whose card names a version holds that version's weights."""
        import json
        import tempfile

        from eagle_ray.model.loading import storage
        with tempfile.TemporaryDirectory() as tmp:
            self.live.save(tmp)
            card = {"adapted_from": base, "version": self.state.version, **self.summary(),
                    "saved_version": self.state.version}
            fs, root = storage(uri, storage_options)
            fs.makedirs(root, exist_ok=True)
            for f in sorted(Path(tmp).iterdir()):
                fs.put(str(f), f"{root}/{f.name}")
            (Path(tmp) / "model_card.json").write_text(json.dumps(card, indent=1))
            fs.put(str(Path(tmp) / "model_card.json"), f"{root}/model_card.json")


def check_save_dir(uri: str, storage_options: dict | None = None) -> None:
    """Fail now, naming ``uri``, where adapted heads could not be written (a folder this process may not write, a
    path that is a file, an S3 prefix without access): found at the first swap, it would cost every swap's copy."""
    from eagle_ray.errors import ConfigError
    from eagle_ray.model.loading import storage
    try:
        fs, root = storage(uri, storage_options)
        probe = f"{root.rstrip('/')}/.write-test-{uuid.uuid4().hex[:8]}"
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001 - any filesystem's error says the same: heads cannot go there
        raise ConfigError(f"engine.adaptation.save_dir {uri}: adapted heads cannot be written there "
                          f"({type(e).__name__}: {e}); give a folder or s3:// prefix the actors can write") from None


def adapt(engine):
    """Attach an :class:`Adapter` to ``engine`` as its ``engine.adaptation`` config says (the job's actors and Serve's
    replicas call this; so can a Python user); returns it, or None where adaptation is off or there is no head."""
    cfg = engine.config.adaptation
    if not cfg.enabled or engine.draft is None:
        return None
    engine.adapter = Adapter(engine.draft, engine.target.lm_head_weight, cfg)
    return engine.adapter


def fresh_copy(head):
    """A trainable fp32 copy of ``head`` (its runtime parts, cache and scorer, left out); the embedding stays
    frozen, as offline training keeps it."""
    saved = {name: getattr(head, name, None) for name in ("cache", "lm_score", "lm_weight")}
    for name in saved:
        setattr(head, name, None)
    try:
        with torch.inference_mode(False):
            cand = copy.deepcopy(head)
    finally:
        for name, value in saved.items():
            setattr(head, name, value)
    with torch.inference_mode(False):
        for p in cand.parameters():
            p.data = p.data.clone().float()
            p.requires_grad_(True)
    cand.embed_tokens.weight.requires_grad_(False)
    return cand
