"""transformers' RoPE initialisation functions transcribed to NumPy (float64), step by step as
``transformers/modeling_rope_utils.py`` (5.24) writes them, to check `lm.rope` without torch.

``rope_parameters`` is a config's standardised dict (``rope_type``, ``rope_theta`` and the type's keys,
``original_max_position_embeddings`` filled in from ``max_position_embeddings`` as transformers does).
"""

import math

import numpy as np


def default(p, dim, max_pos, seq_len=None):
    base = p["rope_theta"]
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim)), 1.0


def linear(p, dim, max_pos, seq_len=None):
    inv_freq, attention_factor = default(p, dim, max_pos)
    return inv_freq / p["factor"], attention_factor


def dynamic(p, dim, max_pos, seq_len=None):
    base, factor = p["rope_theta"], p["factor"]
    seq_len = max_pos if seq_len is None else max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim)), 1.0


def yarn(p, dim, max_pos, seq_len=None):
    base = p["rope_theta"]
    factor = p["factor"]
    attention_factor = p.get("attention_factor")
    mscale = p.get("mscale")
    mscale_all_dim = p.get("mscale_all_dim")
    original_max_position_embeddings = p["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / original_max_position_embeddings

    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):  # noqa: A002 (transformers' names)
        if min == max:
            max += 0.001
        linear_func = (np.arange(dim, dtype=np.float64) - min) / (max - min)
        return np.clip(linear_func, 0, 1)

    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    truncate = p.get("truncate", True)
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2)
    inv_freq = inv_freq_interpolation * (1 - inv_freq_extrapolation_factor) + inv_freq_extrapolation * inv_freq_extrapolation_factor
    return inv_freq, attention_factor


def llama3(p, dim, max_pos, seq_len=None):
    inv_freq, attention_factor = default(p, dim, max_pos)
    factor = p["factor"]
    low_freq_factor = p["low_freq_factor"]
    high_freq_factor = p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq_llama, attention_factor


INIT_FUNCTIONS = {"default": default, "linear": linear, "dynamic": dynamic, "yarn": yarn, "llama3": llama3}


def deepseek_softmax_mscale(p):
    """transformers' ``yarn_apply_mscale`` (DeepSeek-V2): the factor on ``qk_head_dim ** -0.5``."""
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim", 0):
        mscale = 0.1 * p["mscale_all_dim"] * math.log(p["factor"]) + 1.0 if p["factor"] > 1 else 1.0
        return mscale * mscale
    return 1.0


def rope_parameters(config: dict) -> dict:
    """A ``config.json``'s RoPE dict standardised as transformers does (either spelling)."""
    p = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    p.setdefault("rope_type", p.get("type", "default"))
    p.setdefault("rope_theta", config.get("rope_theta", 1e6 if config["model_type"] == "mixtral" else 10_000.0))
    if p["rope_type"] in ("llama3", "yarn"):
        p.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return p
