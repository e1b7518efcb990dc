"""Grouped matrix multiplication (the expert matmuls of a dropless mixture-of-experts layer)."""

from kernels_pallas.gmm.api import Tiling, gmm

__all__ = ["Tiling", "gmm"]
