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

# llama.cpp (the llama-cpp-python sdist's vendor/llama.cpp, unpacked and built once into ~/.cache/offload-engine:
# ~8-15 minutes on 2 cores the first time, nothing after) is the reference of the GGUF parity tests: its converter,
# its tokenizer, its greedy output. A failing build fails `make test`; without cmake or a C++ compiler, or where the
# package index cannot be reached, those tests skip with their reason.
# The suite runs on every core (at most 4 workers: each holds its own small checkpoints), one torch thread each;
# worksteal keeps both cores busy through the slow tail (calibrated quantization, the converter's parity tests).
test: $(BIN)/.installed
	$(BIN)/python tools/llama_peer.py build --where-possible
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist worksteal tests

clean:
	rm -rf $(VENV) .cache
