"""The Serve app's configuration (``eagle-ray serve --config serve.yaml`` / ``serve run``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle_ray.config import (EngineConfig, S3Options, StrictModel, gpus_for_ranks, need_a_head_to_speculate,
                              one_gpu_per_engine, read_yaml_mapping, tune_tree_unless_named)


class ServeConfig(StrictModel):
    """``eagle-ray serve --config serve.yaml`` / ``serve run``: one engine per replica behind an OpenAI API."""
    engine: EngineConfig = Field(default_factory=EngineConfig)

    _default_tree = model_validator(mode="before")(tune_tree_unless_named)
    _head = model_validator(mode="after")(need_a_head_to_speculate)
    model_name: str = Field("eagle-ray/smollm2-135m-instruct", description="the id clients send as `model`")
    speculative: bool = True
    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 exposes the server to the network")
    port: int = Field(8000, ge=0, le=65535)
    route_prefix: str = "/"
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica (its torch threads on CPU)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica: at most 1, or N for a target split over N "
                            "GPUs (engine.tensor_parallel N)")
    api_key_env: str | None = Field(None, description="if set, requests need `Authorization: Bearer <value of "
                                    "this environment variable>`")
    max_tokens_cap: int = Field(2048, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, ge=1)
    max_n: int = Field(16, ge=1, le=1024, description="most choices (n) a request may ask per prompt; a request's "
                       "samples share its prompt's prefill")
    max_request_bytes: int = Field(4 * 2**20, ge=1024, description="largest request body (413 above it)")
    split_special_tokens: bool = Field(True, description="tokenise chat message content with special-token text "
                                       "(<|im_end|>, ...) split into plain text, so a client cannot forge a role")
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"] | None = Field(
        None, description="how answers are read for tool calls where the model chooses (tool_choice auto): the "
        "format the target's chat template teaches (hermes: Qwen2.5/Qwen3/Hermes; llama3_json: Llama 3.1-3.3; "
        "mistral: Mistral 7B v0.3/Nemo/Small; pythonic: Llama 3.2/Llama 4; qwen3_coder: Qwen3-Coder); "
        "null: tool_choice auto is refused, named and required calls are served")
    reasoning_parser: Literal["deepseek_r1", "qwen3", "mistral"] | None = Field(
        None, description="a reasoning model's thinking (<think> ... </think>) returned apart from its answer, in "
        "a chat message's reasoning_content, as vLLM's --reasoning-parser: qwen3, deepseek_r1 (and its distills) or "
        "mistral (Magistral's [THINK] ... [/THINK])")
    trust_request_chat_template: bool = Field(False, description="vLLM's --trust-request-chat-template: a chat "
                                              "request may bring its own chat_template (Jinja, run in transformers' "
                                              "sandbox); false: such a request is a 400")
    responses_kept: int = Field(0, ge=0, description="the newest Responses API answers kept (in one Ray actor per "
                                "app, in memory) for previous_response_id, background and "
                                "GET/DELETE /v1/responses/{id}; 0: none kept, as vLLM's default")
    s3: S3Options = Field(default_factory=S3Options)
    stall_floor_s: float = Field(120.0, gt=0, description="an engine step may run this long at least before it "
                                 "counts as stalled")
    stall_factor: float = Field(10.0, gt=1, description="... or this many times the slowest step seen so far, "
                                "whichever is longer; a stalled step fails the engine, /health then answers 503 "
                                "and Serve replaces the replica")

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu(cls, v):
        return one_gpu_per_engine(v, "num_replicas")

    @model_validator(mode="after")
    def _gpus_for_ranks(self):
        gpus_for_ranks(self.num_gpus, self.engine, "num_replicas")
        return self

    @model_validator(mode="after")
    def _default_within_cap(self):
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} is above max_tokens_cap "
                             f"{self.max_tokens_cap}: a request without max_tokens would get more than the cap")
        return self

    @classmethod
    def from_yaml(cls, path, overrides: dict | None = None) -> "ServeConfig":
        """Load a YAML file (None: the defaults); ``overrides`` (``{"port": 8001}``) replace top-level keys before
        validation, so a command-line value is checked like the file's."""
        data = read_yaml_mapping(path, "serve config") if path else {}
        return cls(**{**data, **{k: v for k, v in (overrides or {}).items() if v is not None}})
