"""Rotary position embeddings with context-extension scaling (`ModelConfig.rope_scaling`).

RoPE (Su et al., arXiv:2104.09864) rotates pair ``i`` of a ``d``-wide query or key at position ``m`` by
``m * w_i`` with ``w_i = theta^(-2i/d)``. A scaling changes the frequencies ``w_i`` and may scale the
rotated vectors by an attention factor ``a`` (so the logits by ``a^2``):

- ``linear`` (position interpolation, Chen et al., arXiv:2306.15595): ``w_i / s``.
- ``dynamic`` (dynamic NTK): at a sequence of length ``L`` (the largest position + 1) beyond the original
  context ``L0``, the base becomes ``theta * (s L / L0 - (s - 1))^(d / (d - 2))``; unscaled up to ``L0``.
- ``llama3`` (Llama 3.1): with wavelength ``l_i = 2 pi / w_i``, ``w_i / s`` where ``l_i > L0 / low_freq_factor``,
  ``w_i`` where ``l_i < L0 / high_freq_factor``, and between them
  ``(1 - g) w_i / s + g w_i`` with ``g = (L0 / l_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
- ``yarn`` (Peng et al., arXiv:2309.00071): ``w_i`` blends from ``w_i`` (pairs turning more than
  ``beta_fast`` times over ``L0``) to ``w_i / s`` (fewer than ``beta_slow`` turns) along a linear ramp over
  the pair index, and ``a = m(s, mscale) / m(s, mscale_all_dim)`` with ``m(s, c) = 0.1 c ln s + 1``
  (``a = m(s, 1)`` unless both are set). DeepSeek-V2 (arXiv:2405.04434) also multiplies its softmax scale by
  ``m(s, mscale_all_dim)^2`` (`softmax_scale_factor`).

These follow transformers' ``modeling_rope_utils.py`` (its ``_compute_*_parameters``) and its DeepSeek-V2
attention, so a Llama 3.x, Qwen3 or DeepSeek-V2 checkpoint computes the same logits here; the rotation is
applied wherever a query or key meets a position (training, prefill, the KV cache's decode steps).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig
from lm.layers import rotary_embedding as _rotate


def original_context(cfg: ModelConfig) -> int:
    """``L0``: the context the model was pretrained at (``rope_original_max_len``, else ``max_seq_len``)."""
    return cfg.rope_original_max_len or cfg.max_seq_len


def _mscale(scale: float, coefficient: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0


def attention_factor(cfg: ModelConfig) -> float:
    """``a``: the factor the rotated queries and keys are multiplied by (1 except for ``yarn``)."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return _mscale(cfg.rope_factor, cfg.rope_mscale) / _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return _mscale(cfg.rope_factor)


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """DeepSeek-V2's extra softmax scale ``m(s, mscale_all_dim)^2`` under a scaled RoPE (1 without one)."""
    if cfg.rope_scaling == "none" or not cfg.rope_mscale_all_dim:
        return 1.0
    return _mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


def static_frequencies(cfg: ModelConfig, dim: int) -> np.ndarray:
    """``w_i`` for ``i < dim / 2`` (float64) of every scaling but ``dynamic``, whose frequencies depend on the length."""
    w = cfg.rope_theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    s, l0 = cfg.rope_factor, original_context(cfg)
    if cfg.rope_scaling == "linear":
        return w / s
    if cfg.rope_scaling == "llama3":
        wavelength = 2 * math.pi / w
        g = (l0 / wavelength - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        blended = np.where(wavelength > l0 / cfg.rope_low_freq_factor, w / s, (1 - g) * w / s + g * w)
        return np.where(wavelength < l0 / cfg.rope_high_freq_factor, w, blended)
    if cfg.rope_scaling == "yarn":
        # the pair index at which a frequency turns `turns` times over l0, bounded to [0, dim - 1]
        index = lambda turns: dim * math.log(l0 / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))  # noqa: E731
        low, high = index(cfg.rope_beta_fast), index(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = np.clip((np.arange(dim // 2) - low) / (high - low if high != low else 0.001), 0, 1)
        return w / s * ramp + w * (1 - ramp)
    return w


def frequencies(cfg: ModelConfig, dim: int, positions: jax.Array) -> jax.Array:
    """``w_i`` (float32, ``(dim / 2,)``) for a call at ``positions``."""
    if cfg.rope_scaling != "dynamic":
        return jnp.asarray(static_frequencies(cfg, dim), jnp.float32)
    s, l0 = cfg.rope_factor, original_context(cfg)
    length = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1, l0)
    base = cfg.rope_theta * (s * length / l0 - (s - 1)) ** (dim / (dim - 2))
    return base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def rotary_embedding(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RoPE of ``x`` ``(batch, seq, heads, dim)`` at ``positions`` ``(seq,)`` with ``cfg``'s theta and scaling."""
    if cfg.rope_scaling == "none":
        return _rotate(x, positions, cfg.rope_theta)
    return _rotate(x, positions, cfg.rope_theta, freqs=frequencies(cfg, x.shape[-1], positions), scale=attention_factor(cfg))
