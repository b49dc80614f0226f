"""bench/gpu_check.py at a tiny shape on the CPU: the command a GPU machine runs works end to end."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import gpu_check  # noqa: E402


def test_gpu_check_runs_at_a_tiny_shape_on_cpu(tmp_path):
    out = gpu_check.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,8",
                          "--widths", "1,8", "--depths", "0,2", "--prompts", "4", "--tokens", "16",
                          "--max-model-len", "512", "--out", str(tmp_path / "check.json")])
    tiny = out["shapes"]["tiny"]
    assert set(tiny["verify_ms"]) == {1, 8} and set(tiny["verify_ms"][8]) == {1, 8}
    assert set(tiny["draft_tree_ms"][1]) == {0, 2}
    assert [tiny["decode_step"][b]["host_reads"] for b in (1, 8)] == [1, 1]
    assert all(0 <= tiny["decode_step"][b]["non_forward_fraction"] < 1 for b in (1, 8))
    assert tiny["greedy"]["equal"] == 4 and tiny["greedy"]["differences"] == []
    assert (tmp_path / "check.json").exists()
