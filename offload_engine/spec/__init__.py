"""Sampling, drafting, verification and the decode loop (see decoder.py's glossary)."""
