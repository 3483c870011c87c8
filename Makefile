# Two entry points (see README): `make demo` and `make test`. Everything lives in a local .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_MODEL := .cache/demo-model

.PHONY: setup demo test clean
setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

$(DEMO_MODEL)/config.json: $(BIN)/.installed tools/make_checkpoint.py
	$(BIN)/python tools/make_checkpoint.py --arch qwen3_moe --preset small --out $(DEMO_MODEL) --force

demo: $(DEMO_MODEL)/config.json
	$(BIN)/offload-engine run --ram 70% --context 512 --prompt "def fibonacci(n):" --max-new-tokens 32 --stats

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .cache
