"""scripts/copy_floor.py on the CPU: every published bench cell has its compulsory bytes from the named workloads (no
name parsed back), and without a GPU the script says so instead of timing."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import copy_floor  # noqa: E402


def test_every_published_cell_has_its_bytes():
    sizes = copy_floor.cell_bytes()
    for path in copy_floor.BENCHES:
        for r in json.loads(path.read_text())["rows"]:
            nbytes = sizes[(r["layer"], r["kind"])]
            if r.get("ours_gbs") and r.get("ours_us"):  # the bench's GB/s counts the same bytes
                assert abs(r["ours_gbs"] * r["ours_us"] * 1e3 - nbytes) <= 1e-6 * nbytes, r["layer"]


def test_without_a_gpu_it_times_nothing(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert copy_floor.main([]) == 3
    assert "needs a GPU" in capsys.readouterr().err
