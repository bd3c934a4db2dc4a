"""Rotations applied to K/V (and weights) before quantization: Hadamard constructions and fitted sets."""
