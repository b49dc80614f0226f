"""Typed configuration: one source of truth for tree shape, sampling and engine settings.

Constructing any of these with a bad value raises :class:`eagle_ray.errors.ConfigError` naming the field.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eagle_ray.errors import ConfigError


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        parts.append(f"{prefix}{loc}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(parts)


class StrictModel(BaseModel):
    """Forbids unknown keys and turns pydantic's ValidationError into our ConfigError."""
    model_config = ConfigDict(extra="forbid", frozen=False)

    def __init__(self, **data):
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ConfigError(f"invalid {type(self).__name__}: {format_validation_error(e)}") from None


class TreeConfig(StrictModel):
    """Shape of the draft tree.

    ``dynamic`` is EAGLE-2: ``depth`` expansion steps with a global ``top_k`` frontier ranked by cumulative draft
    log-probability, then the ``total_tokens`` best nodes (root included) are kept. ``static`` is an EAGLE-1 style
    fixed tree (``static_tree`` paths of sibling ranks), ``chain`` drafts ``depth + 1`` tokens greedily.
    Defaults are the ones measured fastest for the embedded pair on a 2-core CPU (see README).
    """
    mode: Literal["dynamic", "static", "chain"] = "dynamic"
    total_tokens: int = Field(8, ge=1, le=512, description="verify budget per sequence, root included")
    depth: int = Field(2, ge=0, le=32, description="draft expansion steps after the first head output")
    top_k: int = Field(3, ge=1, le=64, description="children per node and frontier width")
    min_cum_prob: float = Field(0.0, ge=0.0, lt=1.0,
                                description="drop nodes whose cumulative draft probability is below this")
    static_tree: list[list[int]] | None = Field(None, description="static mode: node paths as sibling ranks")

    def num_draft_levels(self) -> int:
        return self.depth + 1


class SamplingParams(StrictModel):
    """Per-request sampling, as in vLLM. ``temperature == 0`` is greedy."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off")
    max_new_tokens: int = Field(128, ge=1)
    stop: list[str] = Field(default_factory=list, description="stop strings; not included in the output")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            if "max_tokens" in data and "max_new_tokens" not in data:
                data["max_new_tokens"] = data.pop("max_tokens")
            if isinstance(data.get("stop"), str):
                data["stop"] = [data["stop"]]
        return data

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class EngineConfig(StrictModel):
    """What an engine instance loads and how much it may hold at once."""
    target: str | None = Field(None, description="HF checkpoint dir, .gguf file or s3:// prefix; None = embedded")
    draft: str | None = Field(None, description="EAGLE head dir or s3:// prefix; None = the embedded head")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: str = "auto"
    max_batch_size: int = Field(8, ge=1, le=1024)
    max_model_len: int = Field(2048, ge=16)
    tree: TreeConfig = Field(default_factory=TreeConfig)
    draft_vocab_size: int | None = Field(None, ge=0, description="draft proposes only the N most frequent tokens "
                                         "of the head's token_map (None: all of the map, 0: full vocabulary)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch default)")
    fp32_logits: bool = Field(True, description="compute logits in fp32 when the model runs in bf16/fp16 "
                              "(keeps greedy near-ties stable; costs an fp32 copy of the lm_head)")
