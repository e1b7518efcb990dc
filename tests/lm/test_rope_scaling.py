"""RoPE scaling (lm/rope.py) against a NumPy transcription of transformers' initialisation functions
(tests/lm/rope_reference.py); no torch needed."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from lm import rope
from lm.config import ModelConfig
from lm.layers import rotary_embedding
from tests.lm import rope_reference

BASE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=48, max_seq_len=256)
# (our fields, transformers' rope_parameters); L0 = 32 keeps the interesting pairs inside a 16-wide head
CASES = {
    "linear": (dict(rope_scaling="linear", rope_factor=4.0), dict(rope_type="linear", factor=4.0)),
    "llama3": (
        dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=32),
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),
    ),
    "llama3_theta": (
        dict(rope_scaling="llama3", rope_theta=500_000.0, rope_factor=32.0, rope_low_freq_factor=2.0, rope_high_freq_factor=8.0,
             rope_original_max_len=64),
        dict(rope_type="llama3", rope_theta=500_000.0, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
             original_max_position_embeddings=64),
    ),
    "yarn": (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32), dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    "yarn_deepseek": (
        dict(rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=32, rope_mscale=0.707, rope_mscale_all_dim=0.707),
        dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=0.707),
    ),
    "yarn_mscales_untruncated": (
        dict(rope_scaling="yarn", rope_factor=8.0, rope_original_max_len=48, rope_mscale=1.0, rope_mscale_all_dim=0.5,
             rope_beta_fast=16.0, rope_beta_slow=2.0, rope_truncate=False),
        dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=48, mscale=1.0, mscale_all_dim=0.5, beta_fast=16.0,
             beta_slow=2.0, truncate=False),
    ),
    "yarn_attention_factor": (
        dict(rope_scaling="yarn", rope_factor=2.0, rope_original_max_len=32, rope_attention_factor=1.3),
        dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=32, attention_factor=1.3),
    ),
}  # fmt: skip


def _reference(theirs, cfg, seq_len=None):
    p = {"rope_theta": cfg.rope_theta} | theirs
    return rope_reference.INIT_FUNCTIONS[p["rope_type"]](p, cfg.head_dim, cfg.max_seq_len, seq_len)


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_equal_transformers(name):
    ours, theirs = CASES[name]
    cfg = dataclasses.replace(BASE, **ours)
    inv_freq, factor = _reference(theirs, cfg)
    unscaled, _ = rope_reference.default({"rope_theta": cfg.rope_theta}, cfg.head_dim, cfg.max_seq_len)
    assert not np.allclose(inv_freq, unscaled)  # the case scales something
    np.testing.assert_allclose(rope.static_frequencies(cfg, cfg.head_dim), inv_freq, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(rope.frequencies(cfg, cfg.head_dim, jnp.arange(8))), inv_freq, rtol=1e-6)
    assert rope.attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    assert rope.softmax_scale_factor(cfg) == pytest.approx(rope_reference.deepseek_softmax_mscale(theirs), rel=1e-12)


@pytest.mark.parametrize("seq_len", [5, 32, 33, 100])
def test_dynamic_ntk_follows_the_length(seq_len):
    """transformers recomputes the base from the longest position of the call; unscaled up to max_position_embeddings."""
    cfg = dataclasses.replace(BASE, rope_scaling="dynamic", rope_factor=3.0, rope_original_max_len=32)
    inv_freq, factor = rope_reference.dynamic({"rope_theta": cfg.rope_theta, "factor": 3.0}, cfg.head_dim, 32, seq_len)
    ours = rope.frequencies(cfg, cfg.head_dim, jnp.arange(seq_len)[::-1])  # any order: the largest position counts
    np.testing.assert_allclose(np.asarray(ours), inv_freq, rtol=2e-6)
    unscaled = seq_len <= 32
    assert np.allclose(inv_freq, rope_reference.default({"rope_theta": cfg.rope_theta}, cfg.head_dim, 32)[0]) == unscaled
    assert factor == rope.attention_factor(cfg) == 1.0


def test_rotation_uses_the_scaled_frequencies_and_factor():
    cfg = dataclasses.replace(BASE, **CASES["yarn_mscales_untruncated"][0])
    x = np.random.default_rng(0).standard_normal((1, 6, 2, cfg.head_dim)).astype(np.float32)
    positions = jnp.arange(40, 46)
    inv_freq, factor = _reference(CASES["yarn_mscales_untruncated"][1], cfg)
    angles = np.asarray(positions)[:, None] * inv_freq[None]
    cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
    x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
    expected = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1) * factor
    np.testing.assert_allclose(np.asarray(rope.rotary_embedding(jnp.asarray(x), positions, cfg)), expected, atol=2e-5)


def test_no_scaling_is_bit_identical_to_plain_rope():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, 3, 16)), jnp.float32)
    positions = jnp.arange(100, 109)
    theta = 123_456.0
    half = 8
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # the formula before scaling existed
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    plain = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    cfg = dataclasses.replace(BASE, rope_theta=theta)
    np.testing.assert_array_equal(np.asarray(rope.rotary_embedding(x, positions, cfg)), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(rotary_embedding(x, positions, theta)), np.asarray(plain))
    assert rope.attention_factor(cfg) == rope.softmax_scale_factor(cfg) == 1.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rope_scaling="ntk"), "model.rope_scaling='ntk' must be one of none, linear, dynamic, llama3, yarn"),
        (dict(rope_scaling="linear", rope_factor=0.0), "model.rope_factor=0.0 must be > 0"),
        (dict(rope_scaling="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), "rope_low_freq_factor < model.rope_high"),
    ],
)
def test_bad_scaling_settings_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **changes)


def test_every_scaling_field_is_a_config_flag():
    from experiments import run_spec
    from experiments.configs import default

    config = default.get_config()
    fields = {f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("rope_") and f.name != "rope_head_dim"}
    assert fields <= set(config.model.keys())
    config.update_from_flattened_dict({"model.rope_scaling": "llama3", "model.rope_factor": 8.0, "model.rope_original_max_len": 64})
    cfg = run_spec.model_config(config)
    assert (cfg.rope_scaling, cfg.rope_factor, rope.original_context(cfg)) == ("llama3", 8.0, 64)


@pytest.mark.parametrize("case", ["yarn_deepseek"])  # MLA: its decode absorbs the up-projections, so the scales apply apart
def test_the_kv_cache_decodes_with_the_scaled_rope(case):
    """Prefill and step-by-step decoding through the KV cache equal the full forward pass."""
    from lm import kv_cache
    from lm import model as model_lib

    mla = dict(attention_type="mla", n_kv_heads=4, kv_lora_rank=8, rope_head_dim=8) if case.startswith("yarn") else {}
    cfg = dataclasses.replace(BASE, **CASES[case][0] | mla | dict(rope_original_max_len=4))
    model_def = model_lib.define(cfg)
    params = model_lib.init_params(model_def, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)))
    full = np.asarray(model_lib.apply(model_def, params, tokens))
    cache = kv_cache.init(cfg, 2, 10)
    logits, cache = model_lib.decode(model_def, params, tokens[:, :6], cache, jnp.int32(0))
    steps = [logits]
    for t in range(6, 10):
        logits, cache = model_lib.decode(model_def, params, tokens[:, t : t + 1], cache, jnp.int32(t))
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate([np.asarray(s) for s in steps], axis=1), full, atol=2e-5)
    plain = np.asarray(model_lib.apply(model_lib.define(dataclasses.replace(cfg, rope_scaling="none")), params, tokens))
    assert np.max(np.abs(plain - full)) > 1e-3  # the scaling changes the logits
