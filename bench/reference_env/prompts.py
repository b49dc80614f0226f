"""The prompts a reference run decodes, read and templated without eagle_ray, so that both sides start from the
same token ids."""
from __future__ import annotations

import json


def load_prompts(path: str, num_prompts: int) -> list[dict]:
    """First turns of a JSONL file of records with ``"turns"``, or, from a ``.json`` file holding
    ``{"prompts": [{"id", "prompt_ids"}, ...]}`` (the golden prompts), prompts given as token ids."""
    if path.endswith(".json"):
        with open(path) as f:
            given = json.load(f)["prompts"]
        given = given[:num_prompts] if num_prompts > 0 else given
        return [{"question_id": p["id"], "prompt_ids": [int(t) for t in p["prompt_ids"]]} for p in given]
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if not rec.get("turns"):
                continue
            records.append(rec)
            if num_prompts > 0 and len(records) >= num_prompts:
                break
    return records


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The target's chat template, one user turn, generation prompt added; its default system prompt."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
