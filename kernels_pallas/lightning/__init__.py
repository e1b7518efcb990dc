"""Lightning attention: blocked causal linear attention with per-head decay (Lightning Attention-2, MiniMax-01)."""

from kernels_pallas.lightning.api import lightning_attention

__all__ = ["lightning_attention"]
