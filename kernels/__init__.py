"""Triton kernels and their pure-torch references (no heavy imports here)."""
