"""Flash attention (FlashAttention-2) in Pallas for GPU (Triton) and TPU (Mosaic), with its XLA reference."""

from kernels_pallas.attention.api import BlockSizes, flash_attention
from kernels_pallas.attention.reference import attention as attention_reference

__all__ = ["BlockSizes", "attention_reference", "flash_attention"]
