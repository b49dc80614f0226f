"""The reference checkout: its ``eagle.model`` imported from where it lies (nothing is copied), its commit, and the
environment it ran in, so a recorded run says exactly what produced it."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

DEFAULT_EAGLE_DIR = os.path.join(os.environ.get("REF", "ref"), "EAGLE")
DEFAULT_TARGET = os.path.join(os.environ.get("REF", "ref"), "target")


def import_reference(eagle_dir: str):
    """Import the reference package ``eagle.model`` from a checkout (nothing is copied)."""
    eagle_dir = os.path.abspath(eagle_dir)
    if not os.path.isdir(os.path.join(eagle_dir, "eagle", "model")):
        raise SystemExit(
            f"{eagle_dir} is not a SafeAILab/EAGLE checkout (no eagle/model)"
        )
    if eagle_dir not in sys.path:
        sys.path.insert(0, eagle_dir)
    import transformers

    transformers.logging.set_verbosity_error()  # the reference's KV model classes trigger long, harmless warnings
    import eagle.model.ea_model as ea_model_mod

    return ea_model_mod


def git_commit(path: str) -> str | None:
    """The checkout's commit: ``git rev-parse HEAD``, or a ``COMMIT`` file beside ``eagle/`` (a ``git archive``
    export of one commit has no repository)."""
    stamp = Path(path) / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        out = subprocess.run(
            ["git", "-C", path, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment_info(eagle_dir: str) -> dict:
    import transformers

    return {
        "reference_commit": git_commit(eagle_dir),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
