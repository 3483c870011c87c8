"""Sizes, costs and placement: pure functions of the model's schema, the budget and the hardware."""
