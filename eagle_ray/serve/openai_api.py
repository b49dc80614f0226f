"""OpenAI request/response shapes for completions and chat completions (the subset eagle-ray serves).

Requests are validated here so a bad one becomes a 400 with a reason naming the field, in OpenAI's error body.
Unknown fields are ignored (clients send many), unsupported ones that change semantics (``n > 1``, ``logprobs``)
are refused.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle_ray.stats import RequestStats


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v):
        if v:
            raise ValueError("penalties are not supported (they would change the target's distribution)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    def sampling(self, default_max_tokens: int):
        from eagle_ray.config import SamplingParams
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_new_tokens=self.max_tokens or default_max_tokens, stop=self.stop or [],
                              seed=self.seed, ignore_eos=self.ignore_eos)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request")
            v = v[0]
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def sampling(self, default_max_tokens: int):
        if self.max_completion_tokens and not self.max_tokens:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max_tokens)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def finish_reason(reason: str | None) -> str | None:
    return {"abort": "abort", "stop": "stop", "length": "length"}.get(reason or "", reason)


def eagle_stats(stats: RequestStats) -> dict:
    """Speculative-decoding stats returned with every response (``eagle`` field)."""
    return {"tau": round(stats.tau, 4), "verify_steps": stats.verify_steps,
            "accepted_draft_tokens": sum(stats.accepted_per_depth), "mean_tree_size": round(stats.mean_tree_size, 3),
            "accept_hist": stats.accept_hist, "ttft_s": round(stats.ttft_s, 4)}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
