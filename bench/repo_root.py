"""The repository root on the import path: ``python bench/<entry>.py`` puts only ``bench/`` there, and a device machine
runs the scripts from a copy of the repository with nothing installed (``bench/device/run.sh``). Imported first by
``gpu_step.py`` and ``harness.py`` (which every other entry point imports)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1 if sys.path else 0, str(ROOT))   # after bench/ itself, before site-packages
