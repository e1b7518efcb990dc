"""Grouped matrix multiplication (the expert matmuls of a dropless mixture-of-experts layer)."""

from kernels_pallas.gmm.api import gmm

__all__ = ["gmm"]
