# k3-lora-rl: every target works on a fresh clone; `make install` builds .venv once.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
PYTEST    := $(BIN)/python -m pytest
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: install test test-slow test-interpret test-gpu smoke smoke-gpu smoke-4layer acceptance-full bench clean help

help:
	@echo "make smoke            tiny K3 end to end on CPU: synth MXFP4 ckpt -> BF16 -> LoRA GRPO -> harness verdict"
	@echo "make test             unit + parity tests (CPU), slow ones left out; GPU/cluster tests skip without hardware"
	@echo "make test-slow        the slow-marked tests (multi-rank megatron, every kill -9 point); CI runs them too"
	@echo "make test-interpret   the Triton kernels' tests on the CPU under Triton's interpreter (own venv)"
	@echo "make smoke-gpu        one CUDA GPU: 4layer width, trainer asleep / engine released under a memory cap"
	@echo "make smoke-4layer     one 8-GPU node: 4layer K3 recipe, judged by the harness"
	@echo "make acceptance-full  16x4 GPUs on an existing Ray cluster (RAY_ADDRESS): launch, watch, check, report"

$(STAMP): pyproject.toml ci/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned, so no dependency can pull a multi-GB CUDA build
	$(BIN)/pip install -q -c ci/constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c ci/constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# `slow` tests (multi-rank megatron workers, kill -9 at every point of a run, the wheel rebuild: each > ~20 s on
# 2 cores) run in `make test-slow`, so `make test` stays under 10 minutes on 2 cores; CI runs both.
test: install
	$(PYTEST) -n auto -q -m "not slow" tests/unit tests/parity

test-slow: install
	$(PYTEST) -n auto -q -m slow tests/unit tests/parity

# The Triton kernels' tests on the CPU under Triton's interpreter, in a venv of their own: .venv stays Triton-free
# (a Triton there switches libraries onto GPU kernels). numpy < 2.4: Triton 3.6's interpreter fails on 2.4
# (triton-lang/triton#9171). The tests import k3 from the source tree; of the project's dependencies only what they
# import is installed (megatron-core: the Megatron backend's expert adapters on the kernels).
TVENV     := .venv-triton
TRITON_TESTS := tests/unit/test_lora_grouped.py tests/unit/test_megatron_expert_kernel.py \
	tests/unit/test_gpu_expert_lora.py tests/unit/test_gpu_mxfp4.py tests/unit/test_small_op_kernels.py

$(TVENV)/.installed: ci/constraints.txt Makefile
	test -x $(TVENV)/bin/python || $(PY) -m venv $(TVENV)
	$(TVENV)/bin/pip install -q -c ci/constraints.txt torch==2.13.0
	$(TVENV)/bin/pip install -q -c ci/constraints.txt triton==3.6.0 'numpy>=1.26,<2.4' 'pytest>=8,<10' \
		'pytest-timeout>=2.3,<3' 'typer>=0.12,<1' 'rich>=13,<16' 'tqdm>=4.66,<5' 'safetensors>=0.4,<0.9' \
		megatron-core
	touch $@

test-interpret: $(TVENV)/.installed
	TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR) $(TVENV)/bin/python -m pytest -q $(TRITON_TESTS)

test-gpu: install
	$(PYTEST) -q -m gpu tests/unit tests/parity

smoke: install
	$(BIN)/python -m k3.launch.smoke --run-dir runs/smoke

# No `install`: the script runs on the GPU host's own python (K3_PYTHON, else the first one whose torch sees CUDA),
# with the wheels of `python3 ci/prepare_gpu_wheels.py` from .whl/ when there. Without CUDA: one line, exit 2.
smoke-gpu:
	@bash ci/smoke_gpu.sh

# No `install`: the script runs on the GPU node's own python (K3_PYTHON, else the first one whose torch sees CUDA),
# not on the CPU .venv. DRY_RUN=1 validates and prints the plan only.
smoke-4layer:
	bash ci/smoke_4layer.sh

# Submits from this machine's .venv (ray, k3-harness); DRY_RUN=1 validates the launch and submits nothing: the
# flags, every path, K3_HF_CHECKPOINT the native MXFP4 release and K3_REF_LOAD its torch_dist conversion.
acceptance-full: install
	bash ci/acceptance_full.sh

bench: install
	$(BIN)/python bench/kda_cpu.py

clean:
	rm -rf runs/ .pytest_cache build *.egg-info
