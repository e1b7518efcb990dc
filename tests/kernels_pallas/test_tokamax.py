"""tokamax as an implementation of the attention op and of the grouped matmul (`kernels_pallas.extras`).

Where tokamax imports, its calls are checked against our references, forward and gradients, on CPU
(tokamax's own dispatch then takes its XLA path, so these check the conventions: layout, GQA head
order, causal and segment masks, window, scale, rows past the groups), and a tiny model trains with
``model.attention=tokamax`` as with ``xla``. Where it does not import those skip; the error that names
``pip install spmdlab[tokamax]`` and ``auto``'s silent skip are checked everywhere.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import bench_kernels, train_lib
from kernels_pallas import extras
from kernels_pallas.attention import api, reference
from kernels_pallas.attention import window as window_lib
from kernels_pallas.gmm import api as gmm_api
from lm import config as config_lib
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

needs_tokamax = pytest.mark.skipif(extras.tokamax_missing() is not None, reason=str(extras.tokamax_missing()))
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="tokamax's Pallas kernels need a GPU (a CPU takes its XLA path)")
# Packed documents whose ids repeat out of order (1 after 2): equality, not contiguous runs, defines the mask.
_SEGMENTS = jnp.array([[0] * 5 + [1] * 6 + [2] * 3 + [1] * 2, [3] * 16], jnp.int32)


def _qkv(seed: int = 0, b: int = 2, t: int = 16, heads: int = 4, kv_heads: int = 2, d: int = 8):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, t, heads, d))
    k, v = jax.random.normal(kk, (b, t, kv_heads, d)), jax.random.normal(kv, (b, t, kv_heads, d))
    return q, k, v, jax.random.normal(kc, q.shape)


def _out_and_grads(attend, q, k, v, cotangent):
    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_close(got, want, tol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@needs_tokamax
@pytest.mark.parametrize("segment_ids", [None, _SEGMENTS], ids=["causal", "segments"])
def test_attention_matches_reference_forward_and_backward(segment_ids):
    """Causal GQA (4 query heads on 2 kv heads), with and without segment ids, and the tracked max logits."""
    q, k, v, cotangent = _qkv()
    got = _out_and_grads(lambda q, k, v: api.attention(q, k, v, implementation="tokamax", segment_ids=segment_ids)[0], q, k, v, cotangent)
    want = _out_and_grads(lambda q, k, v: reference.attention(q, k, v, causal=True, segment_ids=segment_ids), q, k, v, cotangent)
    _assert_close(got, want)
    _, max_logits = api.attention(q, k, v, implementation="tokamax", track_max_logits=True, segment_ids=segment_ids)
    _, want_max = reference.attention(q, k, v, causal=True, segment_ids=segment_ids, return_max_logits=True)
    _assert_close(max_logits, want_max)


@needs_tokamax
def test_token_window_matches_the_banded_reference():
    q, k, v, _ = _qkv(seed=1)
    got, _ = api.attention(q, k, v, implementation="tokamax", segment_ids=_SEGMENTS, window_size=4)
    _assert_close(got, window_lib.attention(q, k, v, window=4, segment_ids=_SEGMENTS))
    with pytest.raises(ValueError, match="static token window"):
        api.attention(q, k, v, implementation="tokamax", window_size=4, window_block=2)


@needs_tokamax
def test_grouped_matmul_matches_ragged_dot_forward_and_backward():
    """An empty group and rows past the groups' sum (which come out 0) included."""
    matmul, is_kernel = gmm_api.grouped_matmul("tokamax")
    assert is_kernel  # its Pallas kernels run per shard under a mesh, as ours do
    keys = jax.random.split(jax.random.key(2), 3)
    lhs, rhs, cotangent = jax.random.normal(keys[0], (20, 8)), jax.random.normal(keys[1], (3, 8, 12)), jax.random.normal(keys[2], (20, 12))
    sizes = jnp.array([7, 0, 9], jnp.int32)

    def out_and_grads(fn):
        out, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return out, pullback(cotangent)

    got, want = jax.jit(lambda: out_and_grads(matmul))(), jax.jit(lambda: out_and_grads(jax.lax.ragged_dot))()
    _assert_close(got, want)
    assert not np.any(np.asarray(got[0][16:]))


def _train_losses(attention: str, mesh_spec: str, steps: int = 2) -> np.ndarray:
    cfg = config_lib.from_preset("tiny", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, vocab_size=256, attention=attention)
    model_def, tx = model_lib.define(cfg), optax.adam(1e-2)
    mesh = mesh_lib.make_mesh(mesh_spec, jax.devices()[: 1 if mesh_spec == "data:1" else 4])
    rules = rules_lib.make_rules("tp")
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 17), np.int32)  # one batch, so the loss must fall
    losses = []
    with jax.set_mesh(mesh), partition.use_rules(rules):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        step = train_lib.jit_train_step(train_lib.make_train_step(model_def, tx), shardings)
        for _ in range(steps):
            state, metrics = step(state, train_lib.global_batch(tokens, shardings))
            losses.append(float(metrics["loss"]))
    return np.array(losses)


@needs_tokamax
@pytest.mark.devices(4)
def test_model_trains_like_xla_on_a_sharded_mesh():
    """``model.attention=tokamax`` per shard on a data x tensor mesh (batch and heads split) against XLA on one device."""
    xla, tokamax = _train_losses("xla", "data:1"), _train_losses("tokamax", "data:2,tensor:2")
    assert np.all(np.isfinite(xla)) and xla[-1] < xla[0]
    np.testing.assert_allclose(tokamax, xla, rtol=1e-5)


def test_a_missing_tokamax_is_named_when_chosen_and_skipped_by_auto(monkeypatch, caplog):
    """Runs with or without tokamax: its absence is simulated."""
    reason = "tokamax is not installed (pip install spmdlab[tokamax]): No module named 'tokamax'"
    monkeypatch.setattr(extras, "tokamax_missing", lambda: reason)
    q, k, v, _ = _qkv(t=4)
    with pytest.raises(ValueError, match=r"model.attention=tokamax needs tokamax: .*pip install spmdlab\[tokamax\]"):
        api.attention(q, k, v, implementation="tokamax")
    with pytest.raises(ValueError, match=r"model.moe_matmul=tokamax: .*pip install spmdlab\[tokamax\]"):
        gmm_api.grouped_matmul("tokamax")
    monkeypatch.setitem(api.ORDER, "cpu", ("tokamax", "xla"))
    monkeypatch.setattr(api, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger=api.__name__):
        out, _ = api.attention(q, k, v)
    _assert_close(out, reference.attention(q, k, v, causal=True))
    assert [r.getMessage() for r in caplog.records] == [f"model.attention=auto chose xla: {reason}"]
    assert api.block_implementation("tokamax", "cpu", jnp.float32) == "xla"  # no log-sum-exp for ring attention


def _bf16(*arrays):
    return tuple(x.astype(jnp.bfloat16) for x in arrays)


@needs_tokamax
@on_gpu
def test_bf16_attention_on_a_gpu_runs_a_tokamax_kernel():
    """On a GPU tokamax takes a Pallas kernel (Mosaic GPU on sm90+, else Triton), forward and backward, with
    segment ids; against the float32 reference of the same bf16 inputs."""
    segments = jnp.array([[0] * 100 + [1] * 156, [2] * 256], jnp.int32)
    q, k, v, cotangent = _bf16(*_qkv(seed=3, t=256, d=64))
    attend = jax.jit(lambda q, k, v: api.attention(q, k, v, implementation="tokamax", segment_ids=segments)[0])
    assert bench_kernels.tokamax_kernels(attend, q, k, v) not in ("", "DotProductAttention")
    got = _out_and_grads(attend, q, k, v, cotangent)
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = _out_and_grads(lambda q, k, v: reference.attention(q, k, v, causal=True, segment_ids=segments), *f32, cotangent)
    _assert_close(jax.tree.map(lambda x: x.astype(jnp.float32), got), want, tol=6e-2)


@needs_tokamax
@on_gpu
def test_bf16_grouped_matmul_on_a_gpu_runs_a_tokamax_kernel():
    keys = jax.random.split(jax.random.key(4), 2)
    lhs, rhs = _bf16(jax.random.normal(keys[0], (512, 128)), jax.random.normal(keys[1], (4, 128, 256)))
    sizes = jnp.array([100, 0, 250, 130], jnp.int32)
    matmul = jax.jit(lambda a, b: gmm_api.grouped_matmul("tokamax")[0](a, b, sizes))
    assert bench_kernels.tokamax_kernels(matmul, lhs, rhs) not in ("", "RaggedDot")
    want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    _assert_close(matmul(lhs, rhs).astype(jnp.float32), want, tol=0.5)  # bf16 outputs of 128-term sums of O(1) products
