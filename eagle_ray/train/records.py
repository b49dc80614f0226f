"""Records of how something was made (a training run's identity, a feature directory's extraction.json), compared
before a run adds to what an earlier run left: a run made otherwise is refused, naming each difference."""
from __future__ import annotations


def differences(before: dict, now: dict) -> list[str]:
    """``"key: <before> there, <now> now"`` for every key whose value differs; a key holding a dict on both sides
    (a run's settings) is compared key by key, so the message names the setting, not the whole section."""
    out = []
    for k in sorted(set(before) | set(now), key=str):
        a, b = before.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b)
        elif a != b:
            out.append(f"{k}: {a!r} there, {b!r} now")
    return out
