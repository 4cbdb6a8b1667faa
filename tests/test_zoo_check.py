"""scripts/zoo_check.py end to end on a model of tests/models.py (torchvision's and timm's are not installed here):
the partition of both graphs and one CPU training step through the backend against eager and float64."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))  # `models:resnet18` names tests/models.py

import zoo_check  # noqa: E402


def test_zoo_check_partitions_and_steps_a_model(tmp_path, capsys):
    out = tmp_path / "zoo.jsonl"
    rc = zoo_check.main(["--models", "models:resnet18", "--numerics", "--image", "64", "--numerics-image", "32",
                         "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    tr, inf = rec["partition"]["training"], rec["partition"]["inference"]
    assert tr["failure"] is None and tr["offloaded"] == tr["passes"] == 59 and not tr["left"]
    assert inf["offloaded"] == 20
    num = rec["numerics"]
    assert num["offloaded"] == {"fprop": 20, "dgrad": 19, "wgrad": 20} and not num["flagged"]
    assert num["grad_error"] < 1e-4 and num["loss_error"] < 1e-5 and not num["missing_grads"]
    assert "1 models, 0 model errors, 0 failed" in capsys.readouterr().out
    assert logging.root.manager.disable == logging.NOTSET  # later tests in this process log warnings


def test_helpers_leave_batch_norm_frozen_and_dropout_off():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Dropout(0.5)).train()
    zoo_check.frozen_batch_norm(zoo_check.no_dropout(m))
    assert m.training and m[0].training and not m[1].training and m[2].p == 0.0
    assert zoo_check.image_size("tv:vit_b_16", 96) == 224 and zoo_check.image_size("tv:inception_v3", 64) == 128
    assert zoo_check.image_size("timm:resnet50d", 96) == 96


def test_a_model_spec_without_its_source_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        zoo_check.main(["--models", "resnet50"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--models" in err and "expected tv:NAME, seg:NAME, timm:NAME or pkg.module:factory, got 'resnet50'" in err
