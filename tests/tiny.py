"""Tiny random Llama-family models and a word-level tokenizer, built in seconds for unit tests."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle_ray.config import EngineConfig, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.model.draft_head import DraftHead
from eagle_ray.model.target import TargetModel

CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant : {% endif %}")


def make_tokenizer(vocab_size: int, names: dict[int, str] | None = None) -> PreTrainedTokenizerFast:
    """``names``: words of other spellings at some ids (``<think>`` where ``w25`` was)."""
    special = ["<unk>", "</s>", "<s>"]
    words = special + ["user", "assistant", "system", ":"] + [f"w{i}" for i in range(vocab_size - 7)]
    for i, name in (names or {}).items():
        words[i] = name
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def decode_step_costs(engine) -> tuple[int, int, int]:
    """Once the queued prompts are in and a step has run: the next step's device reads, host-to-device copies and
    uploads nobody staged (a step of requests under any sampling rule should cost (1, 1, 0))."""
    from eagle_ray.engine.host_reads import count_host_reads
    from eagle_ray.uploads import uploads_for
    while engine.scheduler.prefilling:
        engine.step()
    engine.step()
    upload = uploads_for(engine.device)
    copies, misses = upload.copies, upload.misses
    with count_host_reads() as reads:
        engine.step()
    return len(reads.sites), upload.copies - copies, upload.misses - misses


def text_after(tok, prompt_ids, ids) -> str:
    """What ``ids`` add to the text of ``prompt_ids``: an output's text, as the engine reports it."""
    before = tok.decode(list(prompt_ids), skip_special_tokens=True)
    return tok.decode(list(prompt_ids) + list(ids), skip_special_tokens=True)[len(before):]


def make_target(vocab_size: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, model_type: str = "llama",
                logit_scale: float = 1.0, max_positions: int = 1024) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, eos_token_id=1,
              bos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    if model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif model_type == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif model_type == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        model = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=hidden // 4))
    elif model_type == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        model = MistralForCausalLM(MistralConfig(**kw, sliding_window=None))
    else:
        raise ValueError(model_type)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def save_target(path: Path, vocab_size: int = 64, **kw) -> Path:
    model = make_target(vocab_size, **kw)
    model.save_pretrained(path)
    make_tokenizer(vocab_size).save_pretrained(path)
    return path


def tiny_engine(target_dir: Path, head: DraftHead | None = None, tree: TreeConfig | None = None,
                max_batch_size: int = 4, max_model_len: int = 256, dtype=torch.float32,
                max_step_tokens: int = 256, **options) -> EagleEngine:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    target = TargetModel(hf, max_batch_size, max_model_len)
    if head is None:
        torch.manual_seed(1)
        head = DraftHead.for_target(hf.config)
        head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    # a tiny model's step costs next to nothing: a 256-token budget keeps chunking for long prompts, not short ones
    cfg = EngineConfig(tree=tree or TreeConfig(total_tokens=12, depth=3, top_k=3), max_batch_size=max_batch_size,
                       max_model_len=max_model_len, max_step_tokens=max_step_tokens, **options)
    return EagleEngine(target, head.to(dtype).eval(), AutoTokenizer.from_pretrained(target_dir), cfg)


def self_distilled_convs(hf, n: int = 64, prompt_len: int = 6, new_tokens: int = 40, seed: int = 0,
                         capture: tuple[int, ...] | None = None) -> list[dict]:
    """Greedy continuations of random prompts with target features (and, with ``capture``, the layer inputs an
    EAGLE-3 head reads): a drafter learns this in seconds."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, hf.config.vocab_size, (n, prompt_len), generator=g)
    with torch.no_grad():
        out = hf.generate(prompts, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                          pad_token_id=0)
        run = hf.model(input_ids=out, output_hidden_states=bool(capture))
        hidden = run.last_hidden_state
        aux = torch.cat([run.hidden_states[i] for i in capture], -1) if capture else None
    mask = torch.zeros(out.shape[1], dtype=torch.uint8)
    mask[prompt_len:] = 1
    return [{"input_ids": out[i], "loss_mask": mask, "hidden": hidden[i], **({"aux": aux[i]} if capture else {})}
            for i in range(n)]


def trained_head(hf, steps: int = 300, seed: int = 0) -> DraftHead:
    from eagle_ray.train.trainer import TrainConfig, train

    torch.manual_seed(seed)
    head = DraftHead.for_target(hf.config)
    head.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight)
    convs = self_distilled_convs(hf, seed=seed)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        train(convs, head, hf.lm_head.weight.detach(), d,
              TrainConfig(lr=3e-3, warmup_steps=20, epochs=1000, tokens_per_step=512, noise=0.0, eval_fraction=0.0,
                          checkpoint_every=10**9), max_steps=steps, log=lambda *_: None)
    return head.eval()


def wait_healthy(base: str, timeout_s: float, every_s: float = 0.5) -> None:
    """Poll a Serve app's ``/health`` until it answers 200 or ``timeout_s`` passes (the tests' requests then say
    what is wrong, if anything)."""
    import time

    import httpx
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(every_s)


GGUF_VOCAB = 3 + 256   # <unk> </s> <s>, then one token per byte: a byte-level BPE with no merges


def save_gguf(path: Path, model: LlamaForCausalLM) -> Path:
    """``model`` (vocabulary ``GGUF_VOCAB``) as an F32 GGUF file, laid out as llama.cpp writes a Llama: its tensor
    names, and the query and key rows of each head interleaved (transformers' reader undoes that)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode   # byte -> its one-character token
    cfg = model.config

    def interleaved(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tokens = ["<unk>", "</s>", "<s>", *(bytes_to_unicode()[b] for b in range(256))]
    assert cfg.vocab_size == len(tokens) == GGUF_VOCAB
    out = gguf.GGUFWriter(str(path), "llama")
    out.add_block_count(cfg.num_hidden_layers)
    out.add_context_length(cfg.max_position_embeddings)
    out.add_embedding_length(cfg.hidden_size)
    out.add_feed_forward_length(cfg.intermediate_size)
    out.add_head_count(cfg.num_attention_heads)
    out.add_head_count_kv(cfg.num_key_value_heads)
    out.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    out.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    out.add_vocab_size(cfg.vocab_size)
    out.add_file_type(gguf.LlamaFileType.ALL_F32)
    out.add_tokenizer_model("gpt2")
    out.add_token_list(tokens)
    out.add_token_scores([0.0] * len(tokens))
    out.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 256)
    out.add_token_merges([])
    out.add_unk_token_id(0)
    out.add_eos_token_id(1)
    out.add_bos_token_id(2)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    out.add_tensor("output_norm.weight", weights["model.norm.weight"])
    out.add_tensor("output.weight", weights["lm_head.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            w = weights[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                w = interleaved(w, cfg.num_attention_heads if gguf_name == "attn_q" else cfg.num_key_value_heads)
            out.add_tensor(f"blk.{i}.{gguf_name}.weight", w.copy())
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path
