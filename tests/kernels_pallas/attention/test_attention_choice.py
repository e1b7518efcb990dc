"""kernels_pallas.attention.api: which implementation ``auto`` takes per platform, and its fallback log."""

import logging

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import backends
from kernels_pallas.attention import api


def _qkv(dtype=jnp.bfloat16, head_dim=64, v_head_dim=None):
    q = jax.ShapeDtypeStruct((2, 16, 4, head_dim), dtype)
    k = jax.ShapeDtypeStruct((2, 16, 2, head_dim), dtype)
    return q, k, jax.ShapeDtypeStruct((2, 16, 2, v_head_dim or head_dim), dtype)


H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize(
    "platform, kind, dtype, head_dim, v_head_dim, track, chosen, reason",
    [
        ("cpu", "cpu", jnp.bfloat16, 64, None, False, "xla", None),
        ("tpu", "TPU v5 lite", jnp.float32, 64, None, True, "pallas", None),
        ("gpu", H100, jnp.bfloat16, 64, None, False, "cudnn", None),
        ("gpu", H100, jnp.float16, 128, None, False, "cudnn", None),
        ("gpu", H100, jnp.float32, 64, None, False, "xla", "bf16/fp16, not float32"),
        ("gpu", H100, jnp.bfloat16, 256, None, False, "cudnn", None),  # jax allows 256 on Hopper
        ("gpu", A100, jnp.bfloat16, 256, None, False, "pallas", "head_dim <= 128"),
        ("gpu", H100, jnp.bfloat16, 264, None, False, "pallas", "head_dim <= 256"),
        ("gpu", H100, jnp.bfloat16, 192, 128, False, "pallas", "equal q/v head dims"),
        ("gpu", H100, jnp.bfloat16, 64, None, True, "cudnn", None),  # MuonClip: cuDNN + reference.max_logits
        ("rocm", "gfx942", jnp.bfloat16, 64, None, False, "pallas", "ROCm"),
    ],
)
def test_auto_picks_per_platform_and_says_why_it_leaves_cudnn(platform, kind, dtype, head_dim, v_head_dim, track, chosen, reason):
    qkv = _qkv(dtype, head_dim, v_head_dim)
    got, why = api.choose("auto", platform, *qkv, track_max_logits=track, device_kind=kind)
    assert got == chosen
    assert (why is None) if reason is None else (reason in why)
    assert api.choose("xla", platform, *qkv, track_max_logits=track, device_kind=kind) == ("xla", None)


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
    """An H100 seen from CPU: the head_dim-264 call falls back to Pallas (traced, not run) and says so once;
    the float32 call takes XLA and says why once."""
    monkeypatch.setattr(api, "_LOGGED", set())
    with backends.gpu_target(), caplog.at_level(logging.INFO, logger=api.__name__):
        for _ in range(2):
            for dtype, head_dim in ((jnp.bfloat16, 264), (jnp.float32, 64)):
                q, k, v = _qkv(dtype, head_dim)
                out, _ = jax.eval_shape(lambda q, k, v: api.attention(q, k, v, implementation="auto"), q, k, v)
                assert out.shape == q.shape
    assert [r.getMessage() for r in caplog.records] == [
        "model.attention=auto chose pallas: cuDNN flash attention takes head_dim <= 256 and a multiple of 8 on "
        "NVIDIA H100 80GB HBM3, not 264",
        "model.attention=auto chose xla: cuDNN flash attention takes bf16/fp16, not float32; float32 attention on a GPU "
        "runs in XLA (the Triton kernel is tuned and measured for bf16/fp16)",
    ]
