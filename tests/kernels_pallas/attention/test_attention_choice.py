"""kernels_pallas.attention.api: which implementation ``auto`` takes per platform, and its fallback log."""

import logging

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.attention import api


def _qkv(dtype=jnp.bfloat16, head_dim=64, v_head_dim=None):
    q = jax.ShapeDtypeStruct((2, 16, 4, head_dim), dtype)
    k = jax.ShapeDtypeStruct((2, 16, 2, head_dim), dtype)
    return q, k, jax.ShapeDtypeStruct((2, 16, 2, v_head_dim or head_dim), dtype)


@pytest.mark.parametrize(
    "platform, dtype, head_dim, v_head_dim, track, chosen, reason",
    [
        ("cpu", jnp.bfloat16, 64, None, False, "xla", None),
        ("tpu", jnp.float32, 64, None, True, "pallas", None),
        ("gpu", jnp.bfloat16, 64, None, False, "cudnn", None),
        ("gpu", jnp.float32, 64, None, False, "pallas", "bf16/fp16, not float32"),
        ("gpu", jnp.bfloat16, 192, None, False, "pallas", "head_dim <= 128"),
        ("gpu", jnp.bfloat16, 64, 32, False, "pallas", "equal q/v head dims"),
        ("gpu", jnp.bfloat16, 64, None, True, "pallas", "max logits"),
        ("rocm", jnp.bfloat16, 64, None, False, "pallas", "ROCm"),
    ],
)
def test_auto_picks_per_platform_and_says_why_it_leaves_cudnn(platform, dtype, head_dim, v_head_dim, track, chosen, reason):
    got, why = api.choose("auto", platform, *_qkv(dtype, head_dim, v_head_dim), track_max_logits=track)
    assert got == chosen
    assert (why is None) if reason is None else (reason in why)
    assert api.choose("xla", platform, *_qkv(dtype, head_dim, v_head_dim), track_max_logits=track) == ("xla", None)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_auto_keeps_xla_for_a_sharded_sequence(platform):
    chosen, why = api.choose("auto", platform, *_qkv(), track_max_logits=False, sequence_sharded=True)
    assert chosen == "xla" and "sequence is sharded" in why


def test_every_platform_order_ends_in_an_implementation_that_always_serves():
    for platform, order in api.ORDER.items():
        assert set(order) <= set(api.IMPLEMENTATIONS), platform
        assert order[-1] == "xla", platform


def test_an_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'; use one of auto, xla, cudnn, pallas"):
        api.choose("flash", "cpu", *_qkv(), track_max_logits=False)


def test_auto_logs_each_fallback_once(monkeypatch, caplog):
    """A GPU seen from CPU: the fp32 call falls back to Pallas (traced, not run) and says so once."""
    monkeypatch.setattr(api, "platform", lambda: "gpu")
    monkeypatch.setattr(api, "_LOGGED", set())
    q, k, v = _qkv(jnp.float32)
    with caplog.at_level(logging.INFO, logger=api.__name__):
        for _ in range(2):
            out, _ = jax.eval_shape(lambda q, k, v: api.attention(q, k, v, implementation="auto"), q, k, v)
    assert out.shape == q.shape
    assert [r.getMessage() for r in caplog.records] == [
        "model.attention=auto chose pallas: cuDNN flash attention takes bf16/fp16, not float32"
    ]
