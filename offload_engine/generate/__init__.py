"""Plain decoding: sampling (sampling.py) and the generator loop that turns steps into events (decoder.py)."""
