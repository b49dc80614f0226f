"""Typed configuration: one source of truth for tree shape, sampling and engine settings.

Constructing any of these with a bad value raises :class:`eagle_ray.errors.ConfigError` naming the field.
"""
from __future__ import annotations

import contextvars
from typing import Annotated, Literal

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, JsonValue, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from pydantic_core import PydanticCustomError

from eagle_ray.errors import ConfigError


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        if e["type"] == CONFLICT:   # fields that do not go together: the message names them, the input is them all
            parts.append(f"{prefix}{loc}: {e['msg']}" if e["loc"] else f"{prefix}{e['msg']}")
            continue
        got = repr(e.get("input"))
        got = got if len(got) <= 200 else got[:200] + "..."   # a chat template's text may be pages long
        parts.append(f"{prefix}{loc}: {e['msg']} (got {got})")
    return "; ".join(parts)


CONFLICT = "conflict"


def conflict(message: str) -> PydanticCustomError:
    """A model's check of several fields at once: reported by its message alone, which names them."""
    return PydanticCustomError(CONFLICT, message)


_nesting = contextvars.ContextVar("eagle_ray_config_nesting", default=0)


class StrictModel(BaseModel):
    """Forbids unknown keys and turns pydantic's ValidationError into our ConfigError (at the outermost model,
    so a nested mistake is reported with its full dotted path, e.g. ``actors.num_actors``)."""
    model_config = ConfigDict(extra="forbid", frozen=False)

    def __init__(self, **data):
        outer = _nesting.get()
        token = _nesting.set(outer + 1)
        try:
            super().__init__(**data)
        except ValidationError as e:
            if outer:
                raise
            raise ConfigError(f"invalid {type(self).__name__}: {format_validation_error(e)}") from None
        finally:
            _nesting.reset(token)


class TreeConfig(StrictModel):
    """Shape of the draft tree.

    ``dynamic`` is EAGLE-2: ``depth`` expansion steps with a global ``top_k`` frontier ranked by cumulative draft
    log-probability, then the ``total_tokens`` best nodes (root included) are kept. ``static`` is an EAGLE-1 style
    fixed tree (``static_tree`` paths of sibling ranks), ``chain`` drafts ``depth + 1`` tokens greedily. A tree of
    ``total_tokens: 1`` is plain decoding (:data:`PLAIN`): the step verifies only its root and drafts nothing, while
    the head's inputs keep accumulating, so a later step can speculate again.
    The defaults are the tree measured fastest for the embedded pair (docs/benchmarks.md).
    """
    mode: Literal["dynamic", "static", "chain"] = "dynamic"
    total_tokens: int = Field(8, ge=1, le=512, description="verify budget per sequence, root included")
    depth: int = Field(2, ge=0, le=32, description="draft expansion steps after the first head output")
    top_k: int = Field(3, ge=1, le=64, description="children per node and frontier width")
    min_cum_prob: float = Field(0.0, ge=0.0, lt=1.0,
                                description="drop nodes whose cumulative draft probability is below this")
    static_tree: list[list[int]] | None = Field(None, description="static mode: node paths as sibling ranks")
    lookup: int = Field(5, ge=0, le=64, description="prompt lookup: up to this many more verify tokens per "
                        "sequence, the tokens that followed the latest earlier occurrence of its last "
                        "lookup_ngram tokens, grafted onto the draft tree (speculative/lookup.py); 0: off")
    lookup_ngram: int = Field(3, ge=1, le=32, description="tokens a prompt lookup matches")

    @classmethod
    def from_spec(cls, spec: str, **fields) -> "TreeConfig":
        """``total/depth/top_k`` (``8/3/3``) as a dynamic tree, with any other ``fields`` (``lookup=0``): how
        benchmarks name one."""
        try:
            total, depth, top_k = (int(x) for x in spec.split("/"))
        except ValueError:
            raise ValueError(f"tree {spec!r}: write total/depth/top_k, e.g. 8/3/3") from None
        return cls(total_tokens=total, depth=depth, top_k=top_k, **fields)


PLAIN = TreeConfig(total_tokens=1, depth=0, top_k=1, lookup=0)


def is_plain(tree: TreeConfig) -> bool:
    return tree.total_tokens == 1


class SamplingParams(StrictModel):
    """Per-request sampling, as in vLLM. ``temperature == 0`` is greedy."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=2**31 - 1, description="0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="after temperature, tokens less probable than min_p "
                         "times the most probable one are dropped (vLLM's order: before top-k and top-p); 0 = off")
    max_new_tokens: int = Field(128, ge=1, le=2**31 - 1)
    min_tokens: int = Field(0, ge=0, le=2**31 - 1, description="stop tokens (EOS, stop_token_ids) cannot be chosen "
                            "before this many output tokens, and stop strings ending in their text do not stop")
    stop: list[str] = Field(default_factory=list, description="stop strings; not included in the output")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(False, description="keep the stop string (or a stop token's text) "
                                             "that ended the output in its text")
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(True, description="false: special tokens' text stays in the output text")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="the output's tokens are chosen among these ids only")
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="words the output may not hold, as vLLM bars them: each word's tokens (with and without a "
        "leading space), its last token barred where the output so far ends with the others")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31 - 1, description="keep only the prompt's "
                                               "last this many tokens (after templating); -1: as many as fit")
    # penalties, logit bias and structured output, as vLLM reads them (speculative/penalties.py, grammar.py)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once per earlier output "
                                     "occurrence of a token")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from tokens already in the output")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="tokens of the prompt or "
                                      "output: positive logits divided by it, negative ones multiplied; 1 = off")
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id -> bias added to its logit (-100 to 100)")
    guided_json: dict | None = Field(None, description="a JSON schema the output must satisfy (a JSON string is read)")
    guided_regex: str | None = Field(None, min_length=1, description="a regular expression the output must match")
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="the output is exactly one of these strings")
    guided_grammar: str | None = Field(None, min_length=1, description="an EBNF (GBNF) grammar the output must match")
    guided_structural_tag: dict | None = Field(
        None, description="xgrammar's structural tag (vLLM's response_format structural_tag): free text, with "
        "each segment that opens with a trigger held to its tag's schema")
    # what a request gets back besides its text: log-probabilities, and several samples of one prompt
    logprobs: int | None = Field(None, ge=0, le=20, description="per output token, the target's raw "
                                 "log-probability (before temperature, top-k, top-p, penalties, logit bias and grammar "
                                 "masks) and the k most probable "
                                 "alternatives; 0: the chosen token's alone; None: off")
    n: int = Field(1, ge=1, le=1024, description="samples of the prompt, each one sequence; the prompt is "
                   "prefilled once for all of them (engine/samples.py)")
    prediction: str | None = Field(None, min_length=1, description="OpenAI's predicted output: text the output is "
                                   "expected to repeat much of (a file being edited); the tree's prompt lookups "
                                   "draft from it too (speculative/lookup.py). Output unchanged, only faster")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="per prompt token but the first, the "
                                        "target's raw log-probability and the k most probable alternatives, as "
                                        "vLLM's (engine/scoring.py); None: off")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="vLLM's: a waiting request of lower priority "
                          "takes a free slot first (equal ones in arrival order); a running one is never paused")

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

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v):
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v):
        if v and min(v) < 0:
            raise ValueError(f"keys must be token ids (0 or more), got {min(v)}")
        return v or None

    @field_validator("guided_json", mode="before")
    @classmethod
    def _schema(cls, v):
        return None if v is None else checked_schema(v)

    @field_validator("guided_regex", "guided_choice", "guided_grammar", "guided_structural_tag")
    @classmethod
    def _one_guide(cls, v, info: ValidationInfo):
        earlier = [name for name in GUIDED_FIELDS if info.data.get(name) is not None]
        if v is not None and earlier:
            raise ValueError(f"{earlier[0]} is given too: a request takes one guided output field")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.truncate_prompt_tokens == 0:
            raise conflict("truncate_prompt_tokens: 0 would keep no prompt (1 or more, or -1: as many as fit)")
        if self.min_tokens > self.max_new_tokens:
            raise conflict(f"min_tokens ({self.min_tokens}) is more than the output may hold (max_new_tokens, or "
                           f"max_tokens: {self.max_new_tokens})")
        guided = self.guided
        if guided and self.allowed_token_ids is not None:   # a grammar and a list could leave no token at all
            raise conflict(f"allowed_token_ids and {guided[0]} are given: a request restricts its tokens one way")
        if guided and self.min_tokens:   # a grammar whose output is complete could only end, which min_tokens bars
            raise conflict(f"min_tokens and {guided[0]} are given: a grammar decides where structured output ends")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def guided(self) -> tuple[str, object] | None:
        """(field, value) of the structured output asked for, if any."""
        return next(((name, getattr(self, name)) for name in GUIDED_FIELDS if getattr(self, name) is not None), None)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_structural_tag")
JSON_OBJECT = {"type": "object"}   # the schema of OpenAI's ``response_format: json_object``: any JSON object


def checked_schema(value) -> dict:
    """A JSON schema given as an object or as JSON text, checked against its metaschema (``jsonschema``), so a
    malformed one is refused when the request is read, naming what is wrong."""
    import json

    import jsonschema
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({str(e).split(';')[0]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"not a valid JSON schema: {e.message}" + (f" (at {where})" if where else "")) from None
    return value


# apply_chat_template's own arguments: the engine sets them (a chat, its generation prompt, token ids back)
CHAT_TEMPLATE_ARGUMENTS = ("conversation", "conversations", "messages", "tools", "documents", "chat_template",
                           "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
                           "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                           "tokenizer_kwargs", "sanitize_control_tokens")


def engine_arguments_in(variables: dict | None) -> list[str]:
    """The names among chat-template ``variables`` that are apply_chat_template's own arguments, sorted."""
    return sorted(set(variables or {}) & set(CHAT_TEMPLATE_ARGUMENTS))


def read_chat_template(value: str) -> str:
    """A chat template's text: ``value`` itself where it holds Jinja (``{{`` or ``{%``), else the file it names,
    read where the config is read (a job's driver), so actors on other nodes get the text. A template that holds
    no Jinja (it could not place a message) or that transformers' template compiler refuses is refused here, naming
    the line."""
    from pathlib import Path

    text = value
    if not is_jinja(value):
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:   # no such file, a name too long to be one, unreadable
            raise ValueError(f"{value[:80]!r}{'...' if len(value) > 80 else ''} is neither a Jinja template (no "
                             f"'{{{{' or '{{%') nor a file that can be read ({type(e).__name__})") from None
        if not is_jinja(text):
            raise ValueError(f"{value} holds no Jinja ('{{{{' or '{{%'): a chat template places each message")
    from jinja2 import TemplateSyntaxError
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:   # an older transformers: its environment's extensions aside, the same parser
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        compile_template = ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse
    try:
        compile_template(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"not a valid Jinja template: {e.message} (line {e.lineno})") from None
    return text


def is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


class ModelConfig(StrictModel):
    """Which target and head, and where they run."""
    target: str | None = Field(None, description="HF checkpoint dir, .gguf file or s3:// prefix; None = embedded")
    draft: str | None = Field(None, description="EAGLE head dir or s3:// prefix; None = the embedded head; 'none' = "
                              "target only; 'random' = an untrained head")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    device: str = "auto"
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch default)")
    compile: Literal["off", "inductor", "cuda-graphs"] = Field(
        "off", description="run the target's and the head's forwards through torch.compile (inductor), or replay "
        "the target's decode passes as CUDA graphs captured by hand (cuda-graphs, CUDA only); off by default: see "
        "README, Models and devices")
    tensor_parallel: int = Field(1, ge=1, le=64, description="processes (GPUs) one engine's target is split over "
                                 "(model/tensor_parallel.py); must divide its attention and KV heads")
    collective_timeout_s: float = Field(30.0, gt=0, le=3600, description="how long a tensor-parallel collective "
                                        "waits for a rank that hangs before the engine fails (one that dies fails it "
                                        "at once)")
    chat_template: str | None = Field(None, description="the Jinja chat template chat prompts (messages, turns) "
                                      "are rendered with instead of the target tokenizer's own: its text, or the "
                                      "path of a file holding it; None = the tokenizer's")

    chat_template_kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="further variables every "
                                                       "chat prompt's template sees, e.g. {enable_thinking: false} "
                                                       "for Qwen3's")

    @field_validator("chat_template")
    @classmethod
    def _chat_template_text(cls, v):
        return None if v is None else read_chat_template(v)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _none_is_none_given(cls, v):   # a YAML key left empty
        return {} if v is None else v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_engines_own(cls, v):
        taken = engine_arguments_in(v)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the engine for every chat, not a template variable")
        return v


class CacheConfig(StrictModel):
    """What the engine holds at once: KV slots, their length, and how much prompt a step may prefill."""
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        8, description="KV-cache slots: sequences running at once; 'auto': as many as the device's free memory "
        "holds after weights and workspace (model/memory.py; capped per device, model/numerics.py), resolved to an int "
        "when the engine loads")
    max_model_len: int = Field(2048, ge=16, description="positions per slot (prompt + output + one verify budget)")
    max_step_tokens: int | None = Field(None, ge=16, description="tokens one step may run: a token of every "
                                        "running sequence, prompt chunks (at least 16 tokens), then draft tree tokens "
                                        "in what is left; it bounds how long a step stalls the running streams "
                                        "(None: the device's default, model/numerics.py DEVICE_DEFAULTS)")
    step_goal: Literal["latency", "throughput"] = Field(
        "latency", description="the device's step budget when max_step_tokens is None: latency (short steps, so "
        "prompts arriving stall running streams little: Serve) or throughput (wide steps, so trees and prompt chunks "
        "share a step: the batch job and processors); model/numerics.py DEVICE_DEFAULTS")
    prefix_sharing: bool = Field(True, description="a prompt that begins like one in a running sequence's slot "
                                 "copies those positions' K/V and prefills the rest (engine/prefix_sharing.py)")
    memory_share: float | None = Field(None, gt=0, le=1, description="the share of the device's memory this engine "
                                       "plans for with max_batch_size auto (None: all that is free); a Ray actor or "
                                       "replica with num_gpus 0.5 gets 0.5")


class SpeculationConfig(StrictModel):
    """Which draft trees a step grows and how many of their nodes a verify pass may take."""
    tree: TreeConfig = Field(default_factory=TreeConfig)
    tree_policy: Literal["fixed", "auto"] = Field("fixed", description="auto: measure this device at load and pick "
                                                  "the tree per batch size (cached on disk)")
    trees_by_batch: dict[int, TreeConfig] | None = Field(None, description="tree per batch size: a step with n "
                                                         "sequences uses the entry of the largest key <= n")
    verify_cap: int | None = Field(None, ge=1, validation_alias=AliasChoices("verify_cap", "max_verify_tokens"),
                                   description="the most tree nodes one verify pass takes over the whole batch; "
                                   "the most probable nodes across sequences are kept (None: no cap)")
    verify_cap_by_batch: dict[int, int] | None = Field(
        None, validation_alias=AliasChoices("verify_cap_by_batch", "verify_budget_by_batch"),
        description="verify_cap per batch size (the entry of the largest key <= n; the tuner sets it)")
    draft_vocab_size: int | None = Field(None, ge=0, description="draft proposes only the N most frequent tokens "
                                         "of the head's token_map (None: all of the map, 0: full vocabulary)")
    context_vocab: int = Field(256, ge=0, description="a sequence's own context tokens (prompt and output) that "
                               "the head's token map lacks, up to this many, join its draft vocabulary (EAGLE-1/2 "
                               "heads with a map; speculative/context_vocab.py); 0: off")
    measured_choice: bool | None = Field(None, description="per batch size, time speculative and plain steps while "
                                         "running and run the faster (engine/chooser.py); None: on with "
                                         "tree_policy auto, off with fixed trees")

    @field_validator("trees_by_batch")
    @classmethod
    def _batch_keys(cls, v):
        if v is not None and (not v or min(v) < 1):
            raise ValueError("trees_by_batch needs at least one entry and batch sizes >= 1")
        return v

    def trees(self) -> list[TreeConfig]:
        """Every tree this engine may verify."""
        return [self.tree] + list((self.trees_by_batch or {}).values())


Switch = bool | Literal["auto"]


class PrecisionConfig(StrictModel):
    """How a target computes. ``auto`` (the default) turns each numeric switch on for a bf16/fp16 target on CPU, where
    its kernels need them (fp32 targets ignore them), and off on CUDA (model/device.py ``numerics_for``)."""
    fp32_logits: Switch = Field("auto", description="make every logit that can decide a token exact fp32 (bf16 "
                              "product, then the top candidates recomputed in fp32 with a proof that no other token "
                              "can win; model/logits.py): greedy near-ties stay stable")
    fp32_activations: Switch = Field("auto", description="keep the residual stream, norms and attention in fp32 (the "
                                   "projections stay low precision), so a tree verify and plain decoding round alike")
    batch_invariant: Switch = Field("auto", description="with fp32 activations on CPU, compute every token the same way "
                                  "whatever else is in its forward pass (GEMM rows padded to a multiple of 4, chunked "
                                  "attention), so bf16 speculative and plain output differ only on near-ties; costs "
                                  "a 1-row bf16 decode up to ~2x")
    cpu_linears: Literal["auto", "native", "input_major", "packed"] = Field(
        "auto", description="layout of the target's linears on CPU (model/linears.py); auto: oneDNN-packed for fp32 "
        "and for bf16 on CPUs with native bf16 (input-major when model.compile is on), nn.Linear's own for fp16 and "
        "emulated bf16; CUDA keeps them as loaded")
    fused_layers: Switch = Field("auto", description="run each decoder layer in few kernels (q/k/v and gate/up "
                                 "merged, fused norms, residual adds in the output GEMMs; model/fused.py); auto: on "
                                 "CUDA, where a kernel launch costs more than a small one's work")
    tree_attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="attention of the fused layers: sdpa (each row's keys up to the batch's longest, one "
        "mask) or flex (flex attention over the cache as it lies: each row reads only its own slot's keys; "
        "model/tree_attention.py); auto: the device's default (model/numerics.py)")


class AdaptationConfig(StrictModel):
    """Online adaptation (train/online.py): a copy of the head fine-tuned on the (feature, token) pairs the
    engine's own verify passes compute, swapped in only when it scores better on held-back sequences. Output is
    unchanged either way: verification decides every token."""
    enabled: bool = Field(False, description="off by default: it pays on long jobs in one domain the head was not "
                          "trained on (docs/benchmarks.md)")
    buffer_tokens: int = Field(65536, ge=256, description="(feature, token) pairs kept to train on, newest first; "
                               "with the held-back pairs, what bounds the adaptation's memory")
    time_share: float = Field(0.1, gt=0, le=1, description="the most of the engine's time training and scoring "
                              "may take, in slices between steps")
    min_gain: float = Field(0.01, ge=-1, le=1, description="a candidate replaces the live head only if its top-1 "
                            "draft accuracy on held-back sequences beats the live head's by this much")
    round_steps: int = Field(32, ge=1, description="training steps of a candidate before it is scored")
    batch_tokens: int = Field(1024, ge=16, description="pairs per training step")
    lr: float = Field(5e-5, gt=0, description="the candidate's AdamW learning rate")
    hold_back: int = Field(8, ge=2, description="every hold_back-th finished sequence is held back for scoring, "
                           "never trained on")
    save: bool = Field(False, description="the job writes its adapted head next to its outputs (head/<actor>/, "
                       "with a model card), after every swap")
    save_dir: str | None = Field(None, description="where adapted heads go (a directory or s3:// prefix); the job "
                                 "sets it to <output>/head when save is on")


def aliases(name: str, field) -> list[str]:
    """A field's name and its older spellings (``max_verify_tokens`` for ``verify_cap``)."""
    return list(field.validation_alias.choices) if isinstance(field.validation_alias, AliasChoices) else [name]


ENGINE_PARTS = {"model": ModelConfig, "cache": CacheConfig, "speculation": SpeculationConfig,
                "precision": PrecisionConfig}
FLAT_FIELDS = {name: part for part, cls in ENGINE_PARTS.items() for name, field in cls.model_fields.items()
               for name in aliases(name, field)}   # a field's older spellings are sorted into its part too
FIELD_NAMES = {alias: name for cls in ENGINE_PARTS.values() for name, field in cls.model_fields.items()
               for alias in aliases(name, field)}


class EngineConfig(StrictModel):
    """What an engine instance loads and how much it may hold at once, in four parts. The flat form
    (``EngineConfig(dtype="float32", max_batch_size=16)``, or the same keys under ``engine:`` in YAML) is accepted
    and sorted into the parts."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    adaptation: AdaptationConfig = Field(default_factory=AdaptationConfig)

    @model_validator(mode="before")
    @classmethod
    def _sort_flat_fields(cls, data):
        if isinstance(data, dict) and set(data) & set(FLAT_FIELDS):
            data = dict(data)
            for name in [k for k in data if k in FLAT_FIELDS]:
                part = FLAT_FIELDS[name]
                section = {} if data.get(part) is None else data[part]
                if not isinstance(section, dict):
                    raise ValueError(f"{part} is a section of engine settings, got {section!r}")
                section = dict(section)
                if name in section and section[name] != data[name]:
                    raise ValueError(f"{name} is given twice, as {name} ({data[name]!r}) and as {part}.{name} "
                                     f"({section[name]!r}): keep one")
                section[name] = data.pop(name)
                data[part] = section
        return data

    def replace(self, **fields) -> "EngineConfig":
        """A copy with flat fields changed (``engine.replace(tree=..., threads=2)``)."""
        parts = {p: getattr(self, p) for p in ENGINE_PARTS}
        for name, value in fields.items():
            part = FLAT_FIELDS[name]
            parts[part] = parts[part].model_copy(update={FIELD_NAMES.get(name, name): value})
        return self.model_copy(update=parts)

    def for_ray_worker(self, num_cpus: float, num_gpus: float) -> "EngineConfig":
        """A CPU actor/replica runs torch on the CPUs Ray reserved for it (unless ``threads`` says otherwise); one
        with a fraction of a GPU plans its memory from that fraction (unless ``memory_share`` says otherwise)."""
        if self.model.threads is None and num_gpus == 0:   # the ranks of a split target share the CPUs
            return self.replace(threads=max(1, int(num_cpus) // self.model.tensor_parallel))
        if 0 < num_gpus < 1 and self.cache.memory_share is None:
            return self.replace(memory_share=num_gpus)
        return self


def read_yaml_mapping(path, what: str) -> dict:
    """A YAML file's top-level mapping, or a ConfigError that says which file and what is wrong with it."""
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping at the top level")
    return data


# ---- shared by the batch job and the Serve app ----------------------------------------------------------------------
class S3Options(StrictModel):
    """Where s3:// URIs point. Credentials come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
    AWS_SESSION_TOKEN, or an instance role), never from the config file."""
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); default AWS_ENDPOINT_URL")
    region: str | None = Field(None, description="default AWS_DEFAULT_REGION")
    anonymous: bool = False

    def storage_options(self) -> dict:
        """Keyword arguments for ``s3fs.S3FileSystem`` / fsspec."""
        import os
        opts: dict = {"anon": self.anonymous}
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
        region = self.region or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            opts["client_kwargs"] = {"region_name": region}
        return opts


def one_gpu_per_engine(num_gpus: float, more: str) -> float:
    """An engine runs on one GPU per rank of its target: a fraction of one, one, or (``model.tensor_parallel``
    ranks) a whole number; :func:`gpus_for_ranks` checks the number against the ranks."""
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise ValueError(f"one engine uses one GPU per tensor-parallel rank: num_gpus {num_gpus} above 1 must be a "
                         f"whole number (use num_gpus <= 1 and more {more} for more engines)")
    return num_gpus


def gpus_for_ranks(num_gpus: float, engine: "EngineConfig", more: str) -> None:
    """An actor or replica holds one GPU per rank of its engine's target (``model.tensor_parallel``): more would sit
    idle, fewer cannot hold the ranks (CPU engines, ``num_gpus: 0``, run their ranks on the CPU)."""
    ranks = engine.model.tensor_parallel
    if (num_gpus > 1 or ranks > 1) and num_gpus and num_gpus != ranks:
        raise ValueError(f"num_gpus {num_gpus:g} per engine does not match model.tensor_parallel {ranks}: an engine "
                         f"uses one GPU per rank (use num_gpus {ranks}, or more {more} for more engines)")


def tune_tree_unless_named(data):
    """The job and the Serve app tune their tree to the device unless the config names a tree (or never drafts:
    ``speculative: false`` has no tree to tune)."""
    if isinstance(data, dict) and data.get("speculative", True) is not False:
        engine = data.get("engine")
        if engine is None:
            data = {**data, "engine": {"tree_policy": "auto"}}
        elif isinstance(engine, dict):
            spec = engine.get("speculation") if isinstance(engine.get("speculation"), dict) else {}
            if not {"tree", "tree_policy", "trees_by_batch"} & (set(engine) | set(spec)):
                data = {**data, "engine": {**engine, "tree_policy": "auto"}}
    return data


def throughput_steps_unless_named(data):
    """The job and processors have no stream to stall: their steps take the device's throughput budget unless the
    config names a budget."""
    engine = (data.get("engine") or {}) if isinstance(data, dict) else None   # a YAML key left empty is None
    if not isinstance(engine, dict) or not isinstance(engine.get("cache") or {}, dict):
        return data   # not ours to read: the engine's own validation names what is wrong
    cache = engine.get("cache") or {}
    if {"max_step_tokens", "step_goal"} & (set(engine) | set(cache)):
        return data
    if engine.get("cache") is not None:
        return {**data, "engine": {**engine, "cache": {**cache, "step_goal": "throughput"}}}
    return {**data, "engine": {**engine, "step_goal": "throughput"}}


def need_a_head_to_speculate(self):
    """``draft: none`` runs no head: speculation would refuse every request, so the config fails at load."""
    if self.speculative and self.engine.model.draft == "none":
        raise ValueError("engine.draft is 'none' (no draft head) but speculative is true: set speculative: false "
                         "for plain decoding, or name a draft head")
    return self


def spell_engine_key_as(data: dict, key: str) -> None:
    """An engine setting may be written flat (``engine.max_model_len``) or in its part
    (``engine.cache.max_model_len``). Before ``--set key=...`` applies, the file's setting is moved to the spelling
    ``key`` uses, so the override lands on it (and on the part of it ``key`` names) instead of beside it, where the
    two spellings would clash or one would silently win. A file that gives both spellings different values is left
    as it is: the engine section refuses it."""
    keys = key.split(".")
    engine = data.get("engine")
    if keys[0] != "engine" or len(keys) < 2 or not isinstance(engine, dict):
        return
    if len(keys) == 2 and keys[1] in ENGINE_PARTS:                # a whole part: the file's settings of it go
        for name in [n for n in engine if FLAT_FIELDS.get(n) == keys[1]]:
            del engine[name]
    elif keys[1] in FLAT_FIELDS:                                  # flat: engine.<name>[...]
        name, part = keys[1], FLAT_FIELDS[keys[1]]
        section = engine.get(part)
        if isinstance(section, dict) and name in section and engine.get(name, section[name]) == section[name]:
            engine[name] = section.pop(name)
    elif len(keys) >= 3 and FLAT_FIELDS.get(keys[2]) == keys[1]:  # in its part: engine.<part>.<name>[...]
        part, name = keys[1], keys[2]
        section = engine.get(part)
        if name in engine and section is None:
            section = engine[part] = {}
        if name in engine and isinstance(section, dict) and section.get(name, engine[name]) == engine[name]:
            section[name] = engine.pop(name)


def out_path_problem(path: str, directory: bool) -> str | None:
    """Why ``path`` (a directory to fill, or a file to write) cannot be written, found before a run whose results
    would otherwise be lost at its end; None where it can."""
    from pathlib import Path
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        return f"{path} is {'a file' if directory else 'a directory'}; name {'a directory' if directory else 'a file'}"
    for parent in p.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{path} lies under {parent}, which is a file"
    return None


def apply_overrides(data: dict, overrides: dict) -> dict:
    """``data`` (a config file's mapping) with ``overrides`` (dotted keys, ``input.uri``, as ``--set`` gives them)
    applied on top; an engine key lands on the spelling the override uses (``spell_engine_key_as``)."""
    for key, value in overrides.items():
        spell_engine_key_as(data, key)
        node = data
        *parents, last = key.split(".")
        for i, p in enumerate(parents):
            if node.get(p) is None:   # an empty section (``cache:`` in YAML) takes the override
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parents[: i + 1])} is a value, not a section")
        node[last] = value
    return data
