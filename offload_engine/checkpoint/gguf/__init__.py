"""GGUF files (llama.cpp's format) read in place: headers by the `gguf` package (reader.py), metadata as a config
(config.py), llama.cpp's tensor names mapped to the architectures' (names.py), the opened checkpoint (model.py)
and the tokenizer from the metadata (tokenizer.py)."""
