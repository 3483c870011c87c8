"""Speculative decoding: drafters, draft trees, the lossless verifier, the cost-based chooser and the stepper."""
