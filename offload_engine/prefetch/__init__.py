"""Speculative prefetch: predict the next layers' experts and read them while the current layer computes."""
