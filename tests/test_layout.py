"""The house's shape: imports flow down the layers the README draws, no two files import each other, building an
engine reads each checkpoint's config once, and the README and docs render as written."""
import builtins
import io
import re
from collections import Counter
from pathlib import Path

from repo_scripts import ROOT, load

from eagle_ray.config import EngineConfig

graph = load("scripts/import_graph.py")


def test_every_part_of_the_package_has_a_layer_and_imports_only_its_own_or_lower_ones():
    parts = {p.name.removesuffix(".py") for p in graph.PACKAGE.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert parts == set(graph.LAYER)
    assert graph.upward_imports() == []


def test_no_files_or_parts_import_each_other():
    assert graph.circles(graph.module_graph()) == []
    assert graph.circles(graph.part_graph()) == []


def test_the_circle_check_finds_a_loop():
    assert graph.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_building_an_engine_reads_each_checkpoint_config_once(tiny_dir, tmp_path, monkeypatch):
    from tiny import make_target

    from eagle_ray.engine.engine import EagleEngine
    from eagle_ray.model.draft_head import DraftHead
    DraftHead.for_target(make_target().config).save(tmp_path / "head")
    reads = Counter()
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "config.json":
            reads[str(Path(file).resolve().parent)] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    engine = EagleEngine.from_config(EngineConfig(target=str(tiny_dir), draft=str(tmp_path / "head"),
                                                  dtype="float32", max_batch_size=2, max_model_len=64))
    assert engine.draft.kind == "eagle2"
    assert reads == {str(Path(tiny_dir).resolve()): 1, str((tmp_path / "head").resolve()): 1}


def test_a_jobs_driver_imports_no_model_code():
    """The package's names load on first use: a process that imports the job (a driver, `--help`, a config error)
    starts in about half a second instead of loading transformers' model code and torch's compiler (6-7 s here)."""
    import subprocess
    import sys
    probe = ("import sys, eagle_ray.batch.job, eagle_ray.batch.rows; "
             "print(sorted(m for m in ('torch._dynamo', 'transformers.models.llama.modeling_llama', "
             "'eagle_ray.engine.engine') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]
    from eagle_ray import EagleEngine, SamplingParams   # the public names still resolve
    assert EagleEngine.__module__ == "eagle_ray.engine.engine" and SamplingParams.__module__ == "eagle_ray.config"


def test_an_engine_process_imports_neither_transformers_model_code_nor_torchs_compiler(tiny_dir, tmp_path):
    """An engine runs its own decoder modules (model/decoder.py) from its own config reader (decoder_config.py): a
    Ray Data actor or a Serve replica starts without transformers' model code and config classes (whose validators
    import ``torch.distributed.tensor``) or torch's compiler; transformers reads the tokenizer."""
    import subprocess
    import sys

    from tiny import make_target

    from eagle_ray.model.draft_head import DraftHead
    DraftHead.for_target(make_target().config).save(tmp_path / "head")
    probe = ("import sys; from eagle_ray.engine.engine import EagleEngine; "
             f"e = EagleEngine.from_pretrained({str(tiny_dir)!r}, {str(tmp_path / 'head')!r}, dtype='float32', "
             "max_batch_size=1, max_model_len=64); e.generate([[5, 6, 7]]); "
             "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.', "
             "'transformers.modeling_utils', 'transformers.activations', 'torch.distributed.tensor', 'torch._dynamo', "
             "'torch._inductor'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


def fence_errors(text: str) -> list[str]:
    """Code fences that would not render as written: a fence line with text after it (Markdown does not close a
    block there, so the block runs on and swallows the headings below) and a block left open at the end."""
    errors, open_at = [], None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        if open_at is None and re.fullmatch(r" *```[\w+-]*", line):
            open_at = n
        elif open_at is not None and re.fullmatch(r" *```", line):
            open_at = None
        else:
            errors.append(f"line {n}: {line[:60]!r}")
    return errors + ([f"line {open_at}: a code block never closed"] if open_at is not None else [])


def test_every_code_block_in_the_readme_and_docs_opens_and_closes_on_a_line_of_its_own():
    assert fence_errors("```python\nx = 1\n``` then text\n\n## A heading\n```\n") == \
        ["line 3: '``` then text'"]
    assert fence_errors("```bash\nrun\n") == ["line 1: a code block never closed"]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert {str(p.relative_to(ROOT)): e for p in pages if (e := fence_errors(p.read_text()))} == {}
