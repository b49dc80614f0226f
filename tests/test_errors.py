"""Bad input raises a typed error whose message says what to fix."""
import pytest
import torch
from tiny import make_target, tiny_engine
from transformers import LlamaConfig

from eagle_ray.config import EngineConfig, SamplingParams, TreeConfig
from eagle_ray.engine.engine import EagleEngine
from eagle_ray.errors import CheckpointError, ConfigError, InvalidRequestError, PromptTooLongError
from eagle_ray.model.draft_head import DraftHead


@pytest.mark.parametrize("kw,field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_new_tokens"),
    ({"temprature": 1.0}, "temprature"), ({"max_new_tokens": 10**19}, "max_new_tokens"),
])
def test_invalid_sampling_values_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kw)
    assert field in str(e.value)


def test_invalid_tree_and_engine_values():
    with pytest.raises(ConfigError, match="total_tokens"):
        TreeConfig(total_tokens=0)
    with pytest.raises(ConfigError, match="mode"):
        TreeConfig(mode="bushy")
    with pytest.raises(ConfigError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)


def test_mismatched_head_fails_before_the_target_loads(tiny_dir, tmp_path):
    other = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=1)
    DraftHead.for_target(other).save(tmp_path / "head")
    with pytest.raises(CheckpointError, match="head hidden_size=48, target hidden_size=32"):
        EagleEngine.from_pretrained(target=str(tiny_dir), draft=str(tmp_path / "head"))


def damaged(head_dir, what):
    """``head_dir`` (a saved head) damaged the way a failed copy or a hand edit leaves it."""
    import torch
    from safetensors.torch import save_file
    if what == "truncated config.json":
        (head_dir / "config.json").write_text('{"hidden_size": 32, ')
    elif what == "config.json not an object":
        (head_dir / "config.json").write_text("[]")
    elif what == "half-copied weights":
        weights = (head_dir / "model.safetensors").read_bytes()
        (head_dir / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    elif what == "2-D token map":
        save_file({"token_map": torch.arange(10).view(2, 5)}, str(head_dir / "token_map.safetensors"))


@pytest.mark.parametrize("what,reason", [
    ("truncated config.json", "config.json cannot be read as JSON"),
    ("config.json not an object", "config.json must hold a JSON object, got list"),
    ("half-copied weights", "model.safetensors cannot be read .* is the file complete"),
    ("2-D token map", "token_map.safetensors must hold one 1-D integer tensor 'token_map', got \\(\\(2, 5\\)"),
])
def test_a_damaged_head_fails_at_load_naming_its_file(tiny_dir, tmp_path, what, reason):
    from transformers import AutoConfig
    DraftHead.for_target(AutoConfig.from_pretrained(tiny_dir)).save(tmp_path / "head")
    damaged(tmp_path / "head", what)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'head'}.*{reason}"):
        EagleEngine.from_pretrained(target=str(tiny_dir), draft=str(tmp_path / "head"))


def test_speculation_without_a_head_fails_when_the_config_loads():
    from eagle_ray.batch.config import JobConfig
    from eagle_ray.serve.config import ServeConfig
    for make in (lambda **kw: ServeConfig(**kw), lambda **kw: JobConfig(input={"uri": "x"}, output={"uri": "y"}, **kw)):
        with pytest.raises(ConfigError, match="engine.draft is 'none' .* set speculative: false"):
            make(engine={"draft": "none"})
        assert make(engine={"draft": "none"}, speculative=False).speculative is False


def test_missing_target_files(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        EagleEngine.from_pretrained(target=str(tmp_path / "nope"), draft="none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        EagleEngine.from_pretrained(target=str(tmp_path / "empty"), draft="none")
    make_target().config.save_pretrained(tmp_path / "noweights")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        EagleEngine.from_pretrained(target=str(tmp_path / "noweights"), draft="none")
    with pytest.raises(CheckpointError, match="GGUF file .* does not exist"):
        EagleEngine.from_pretrained(target=str(tmp_path / "model.gguf"), draft="none")


def test_prompt_longer_than_the_context(tiny_dir, tiny_head):
    engine = tiny_engine(tiny_dir, tiny_head, max_model_len=64)
    # 64 less one verify budget (12 tree tokens and 5 lookup tokens) and the token a step emits
    with pytest.raises(PromptTooLongError, match="prompt has 60 tokens but the engine fits at most 46"):
        engine.generate([[5] * 60])


@pytest.mark.parametrize("prompt,msg", [
    ("", "prompt is empty"),
    ([{"role": "wizard", "content": "w1"}], "role must be one of"),
    ([{"role": "user"}], r"messages\[0\].content must be a non-empty string"),
    ([999], "outside the vocabulary"),
    (3.5, "prompt must be a non-empty string, a list of chat messages"),
])
def test_malformed_prompts(tiny_dir, tiny_head, prompt, msg):
    engine = tiny_engine(tiny_dir, tiny_head)
    with pytest.raises(InvalidRequestError, match=msg):
        engine.generate([prompt])


def test_every_command_says_in_one_line_what_is_wrong_with_what_it_was_given(tmp_path, capsys):
    """A bad flag, path or config is the user's to fix: ``eagle-ray`` names it on one line and exits 2, before
    any model loads, never with a traceback or by quietly doing less."""
    from eagle_ray.cli import main
    (tmp_path / "bad.yaml").write_text("engine: [1")
    for argv, reason in ((["generate", "--num-prompts", "0"], "--num-prompts must be >= 1"),
                         (["generate", "--num-prompts", "-1"], "--num-prompts must be >= 1"),
                         (["generate", "--prompts", str(tmp_path / "nope.jsonl")], "is not a file"),
                         (["generate", "--device", f"cuda:{torch.cuda.device_count()}", "--num-prompts", "1"],
                          "this machine has"),   # one CUDA device more than there are
                         (["generate", "--device", "bogus", "--num-prompts", "1"], "not a device torch knows"),
                         (["generate", "--temperature", "nan"], "temperature"),
                         (["serve", "--config", str(tmp_path / "nope.yaml")], "cannot read serve config"),
                         (["serve", "--config", str(tmp_path / "bad.yaml")], "serve config"),
                         (["serve", "--port", "70000"], "port"),
                         (["extract", "--source", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "f")],
                          "does not exist"),
                         (["extract", "--source", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "g")],
                          "bad.yaml:1: not a JSON record")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"eagle-ray {argv[0]}: ") and reason in err and err.count("\n") == 1, (argv, err)
    for moved, where in (("measure", "bench/speed.py measure"), ("benchmark", "bench/speed.py table1")):
        assert main([moved, "--prompts", "x.jsonl"]) == 2      # the old subcommands say where they went
        err = capsys.readouterr().err
        assert err.startswith(f"eagle-ray {moved}: moved to python ") and where in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as done:
        main(["extract", "--help"])
    assert done.value.code == 0 and "--max-conversations" in capsys.readouterr().out
