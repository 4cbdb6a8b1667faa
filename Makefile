# cutlass-byoc: the two commands of the README are `make tune` and `make test`; both set up .venv themselves.
PYTHON ?= python3
# The CPU build of torch that lies on this project's machines; on a GPU machine: make TORCH=torch ...
TORCH  ?= torch==2.13.0
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup tune test test-gpu bench gpu-round device-kit zoo fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[torch,dev]'
	touch $(STAMP)

setup: $(STAMP)

## Plan, compile and (with a GPU) time the embedded default workload; without a GPU it says timing was skipped.
tune: $(STAMP)
	@# exit code 3 = no GPU: everything short of timing was done, and the command said so
	$(BIN)/cutlass-byoc tune || [ $$? -eq 3 ]

## The test suite: unit, render and compile-only tests here; gpu-marked tests skip with a reason without a GPU.
test: $(STAMP)
	$(BIN)/pytest -q

test-gpu: $(STAMP)
	$(BIN)/pytest -q -m gpu

bench: $(STAMP)
	$(BIN)/cutlass-byoc bench

## torchvision's and timm's models partitioned, and one CPU training step each through the backend against eager
## (scripts/zoo_check.py; its packages go to .zoo-deps/, outside the venv the tests run in). About 25 minutes on
## 2 cores; e.g. ZOO_ARGS="--models tv:resnet50 timm:ghostnet_100 --amp bf16" for a part.
ZOO_DEPS := .zoo-deps
zoo: $(STAMP)
	@# torchvision and timm without their dependencies (torch is the venv's); timm's own with theirs
	$(BIN)/pip install -q --no-deps --target $(ZOO_DEPS) torchvision==0.28.0 timm
	$(BIN)/pip install -q --target $(ZOO_DEPS) huggingface_hub safetensors pyyaml pillow
	PYTHONPATH=$(ZOO_DEPS) $(BIN)/python scripts/zoo_check.py --numerics $(ZOO_ARGS)

## Random conv programs through the backend on the CPU against eager and float64, each offloaded problem's tuning plan
## built and its kernels rendered (scripts/fuzz_partition.py). About 8 minutes for the default 500 programs (one
## process); e.g. FUZZ_ARGS="--seeds 500:600 --show" for others, "--amp fp16" for the GPU's autocast type.
FUZZ_ARGS ?= --seeds 0:500 --inductor-every 10
fuzz: $(STAMP)
	$(BIN)/python scripts/fuzz_partition.py $(FUZZ_ARGS)

## On the H200 (device tool): install from .whl/, gpu tests, tune, bench, offload bench.
gpu-round:
	bash scripts/gpu_round.sh

## What a GPU round carries (README, "GPU round"), made here: the nvidia-cutlass and platformdirs wheels in .whl/ (the
## device has no package registry) and, packed as .kcache.tar.xz, the kernels of ResNet-50's two tune plans (b32, b64)
## and of the offload and model-family GPU tests (ConvNeXt-T's and EfficientNet-B0's included); KIT_ARGS: other
## scripts/warm_cache.py selectors. 357 kernels and 12.4 MiB by default, about 105 minutes on 2 cores from cold (the
## 3.x kernels take 60-90 s each; ConvNeXt's and EfficientNet's 37 took 542 s of one job), seconds when cached.
KIT_ARGS ?= --tune-model resnet50 --batch 32 64 --offload-tests --families
device-kit: $(STAMP)
	mkdir -p .whl
	$(BIN)/pip download -q --no-deps -d .whl nvidia-cutlass==4.2.0.0 'platformdirs>=3'
	$(BIN)/python scripts/warm_cache.py $(KIT_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(ZOO_DEPS)
