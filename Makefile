# Two entry points (see README): `make demo` and `make test`. Everything lives in a local .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test clean
setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

# the bundled model (offload_engine/data/demo-model, trained by tools/train_demo.py) within a quarter of its size
demo: $(BIN)/.installed
	$(BIN)/offload-engine run --ram 25% --context 512 --spec auto --max-new-tokens 64 --stats \
	  --prompt "$$(printf 'import json\n\n\ndef read_config(path):\n    """Read a JSON file and return a dict."""')"

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .cache
