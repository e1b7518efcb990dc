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
        ("gpu", H100, jnp.bfloat16, 192, 128, False, "pallas", "v's head dim equal to k's"),
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


def _shapes(batch, seq, heads, kv_heads, head_dim, dtype=jnp.bfloat16, v_head_dim=None):
    return (
        jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), dtype),
        jax.ShapeDtypeStruct((batch, seq, kv_heads, v_head_dim or head_dim), dtype),
    )


H200 = "NVIDIA H200"
# The attention calls of the H200 test run (issue 40) and their neighbours: (shapes, keywords of `choose`,
# implementation auto must take, a phrase of its reason or None). gpt2-124m and llama-1b at 1 x 128 tokens
# (`test_large_presets_compile_abstractly`: Q 127, KV 127 in training) died in jax's cuDNN check.
H200_CALLS = [
    (_shapes(1, 127, 12, 12, 64), {}, "pallas", "not Q 127, KV 127"),
    (_shapes(1, 127, 32, 8, 64), {}, "pallas", "placeholder bias"),
    (_shapes(2, 127, 4, 2, 32), {"has_segment_ids": True}, "pallas", "segment ids become a bias"),
    (_shapes(1, 128, 12, 12, 64), {"has_segment_ids": True}, "cudnn", None),
    (_shapes(1, 127, 12, 12, 64), {"training": False}, "cudnn", None),  # forward only: jax checks no bias rule
    (_shapes(1, 127, 12, 12, 64, jnp.float32), {}, "xla", "bf16/fp16, not float32"),
    (_shapes(16, 1024, 12, 12, 64), {}, "cudnn", None),  # the README's gpt2-124m step
    (_shapes(8, 2048, 32, 8, 64), {}, "cudnn", None),  # llama-1b
    (_shapes(2, 64, 4, 4, 48, v_head_dim=32), {}, "pallas", "v's head dim equal to k's"),  # MLA
    (_shapes(2, 64, 4, 2, 256), {"compute_capability": "8.0", "device_kind": "NVIDIA A100"}, "pallas", "head_dim <= 128"),
    (_shapes(2, 64, 4, 2, 256), {"compute_capability": "9.0"}, "cudnn", None),
    (_shapes(2, 64, 4, 2, 64), {"compute_capability": "10.3", "cudnn_version": 91000}, "pallas", "cuDNN >= 9.11"),
    (_shapes(2, 64, 4, 2, 64), {"compute_capability": "10.3", "cudnn_version": 91100}, "cudnn", None),
    # Past the Triton kernel's int32 offsets too: XLA serves it.
    (_shapes(64, 65537, 32, 8, 64), {}, "xla", "int32 offsets"),
]


@pytest.mark.parametrize("qkv, keywords, chosen, reason", H200_CALLS)
def test_auto_takes_what_serves_each_call_of_the_gpu_run(qkv, keywords, chosen, reason):
    got, why = api.choose("auto", "cuda", *qkv, track_max_logits=False, **{"device_kind": H200, **keywords})
    assert got == chosen, why
    assert (why is None) if reason is None else (reason in why)


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
