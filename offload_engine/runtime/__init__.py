"""Pure-torch forward passes over weights obtained from a WeightSource."""
