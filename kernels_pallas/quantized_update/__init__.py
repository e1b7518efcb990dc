"""Fused quantized optimizer-state updates (AdamW, Lion; 8 and 4 bits) in Pallas, with their XLA reference."""

from kernels_pallas.quantized_update.api import BlockSizes, available, quantized_update
from kernels_pallas.quantized_update.base import AdamW, Lion, Moment
from kernels_pallas.quantized_update.reference import (
    quantized_update as quantized_update_reference,
)
from kernels_pallas.quantized_update.reference import rounding_noise

__all__ = ["AdamW", "BlockSizes", "Lion", "Moment", "available", "quantized_update", "quantized_update_reference", "rounding_noise"]
