"""GPU: scripts/fuzz_partition.py's random conv programs on the H200 through the backend and the kernels (the
heuristic's launches, compiled ahead by `scripts/warm_cache.py`), each against eager and float64 with the script's
rules: no crash, no value or gradient further from float64 than eager's allows, no gradient lost. fp16 autocast where
a program uses autocast, TF32 otherwise (as cuDNN's convs). The round's fuzz step runs more seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import fuzz_partition as fz  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (these tests run on the H200)"),
]

SEEDS = (*range(0, 12), 16)
INDUCTOR_SEEDS = (3,)
#: fp32 programs whose flag on the H200 was TF32's rounding (eager under fz.TF32Convs as far off): counted apart
TF32_NOISE_SEEDS = (16,)
#: fp32 training programs that came out non-finite on the kernels on the fiftieth session's H100 (out0 "error inf"),
#: with the C++ and the Python call sites alike: each ran a few-channels fprop with a ReLU epilogue on 4 serial split-k
#: slices, whose CUTLASS functor writes NaN from every slice but the last (LaunchConfig.reject_reason refuses that
#: launch since; tests/test_config.py::test_serial_split_k_never_carries_a_relu)
RELU_SPLIT_SEEDS = (131, 149)


def kernels():
    """What these tests launch (scripts/warm_cache.py's MODULE_KERNELS["fuzz"])."""
    return fz.fuzz_kernels((*SEEDS, *RELU_SPLIT_SEEDS))


@pytest.mark.parametrize("seed", (*SEEDS, *RELU_SPLIT_SEEDS))
def test_random_program_on_the_kernels(seed):
    program, rec = fz.run_seed(seed, inductor=seed in INDUCTOR_SEEDS, plan=False, device="cuda", amp="fp16")
    print(f"\n{program.describe()}\n{rec}")
    assert not fz.failed(rec), (program.describe(), rec)
    assert "invalid" not in rec or "Expected more than 1 value per channel" in rec["invalid"], rec
    if seed in TF32_NOISE_SEEDS:  # seed 16: its conv bias gradient, 7.02e-3 on the kernels and under TF32Convs
        assert [f.split(":")[0] for f in rec["tf32_noise"]] == ["mods.conv0.bias"], rec
    if seed in RELU_SPLIT_SEEDS:  # on the kernels, not the reference
        assert sum(rec["kernel_calls"].values()) >= 14 and not rec["fallbacks"], rec
