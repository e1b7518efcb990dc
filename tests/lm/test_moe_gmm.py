"""``model.moe_matmul``: the Pallas gmm kernel inside the MoE layer equals `jax.lax.ragged_dot`.

On CPU the kernel runs in Pallas interpret mode (the interpreter fills outputs with NaN first, so a row
the kernel forgets to write fails the comparison), per shard inside `jax.shard_map` under a mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lm import config as config_lib
from lm import moe
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib


def test_config_rejects_an_unknown_matmul():
    with pytest.raises(ValueError, match="model.moe_matmul='cutlass' must be one of auto, ragged_dot, gmm"):
        config_lib.from_preset("moe-tiny", moe_matmul="cutlass")


def _layer_and_grads(matmul: str, x: jax.Array, cotangent: jax.Array):
    cfg = config_lib.from_preset("moe-tiny", d_model=16, expert_mlp_dim=24, n_experts=4, n_shared_experts=1, moe_matmul=matmul)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(moe.MoE(cfg, rngs=nnx.Rngs(0)))

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


@pytest.mark.devices(4)
def test_gmm_equals_ragged_dot_in_the_layer_forward_and_backward():
    """On an expert x fsdp mesh: the kernel runs per shard, between the all-to-alls of expert parallelism."""
    x = jax.random.normal(jax.random.key(0), (4, 6, 16))
    cotangent = jax.random.normal(jax.random.key(1), (4, 6, 16))
    results = {}
    with jax.set_mesh(mesh_lib.make_mesh("expert:2,fsdp:2", jax.devices()[:4])), partition.use_rules(rules_lib.make_rules()):
        for matmul in ("ragged_dot", "gmm"):
            results[matmul] = _layer_and_grads(matmul, x, cotangent)
    want, got = jax.tree.leaves(results["ragged_dot"]), jax.tree.leaves(results["gmm"])
    assert len(got) == len(want) > 8  # output, d/dx, router kernel, the three expert stacks, the shared expert
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from all-gathers (which CPUs lower)."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    sources = jax.lax.all_gather(operand, axis_name)
    starts, sizes, targets = (jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    for sender in range(sources.shape[0]):
        inside = (rows >= targets[sender]) & (rows < targets[sender] + sizes[sender])
        source_rows = jnp.clip(starts[sender] + rows - targets[sender], 0, operand.shape[0] - 1)
        output = jnp.where(inside.reshape(-1, *[1] * (output.ndim - 1)), sources[sender][source_rows], output)
    return output


@pytest.mark.devices(8)
def test_ragged_all_to_all_dispatch_offsets_match_one_device(monkeypatch):
    """The GPU/TPU dispatch (`moe.ragged_dispatch`) on 8 CPU devices, its collective emulated by definition:
    the offsets it computes put every slot on its expert's device and every result back in place."""
    x = jax.random.normal(jax.random.key(2), (8, 5, 16))
    cotangent = jax.random.normal(jax.random.key(3), (8, 5, 16))
    single = _layer_and_grads("ragged_dot", x, cotangent)
    monkeypatch.setattr(moe.gmm_api, "platform", lambda: "cuda")  # selects ragged_dispatch
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    with jax.set_mesh(mesh_lib.make_mesh("expert:4,fsdp:2")), partition.use_rules(rules_lib.make_rules()):
        sharded = _layer_and_grads("ragged_dot", x, cotangent)
    for g, w in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "cpu" or jax.device_count() < 2, reason="ragged_all_to_all needs 2+ GPUs or TPUs")
def test_ragged_all_to_all_dispatch_matches_one_device_on_accelerators():
    n = min(jax.device_count(), 4)
    x = jax.random.normal(jax.random.key(2), (n * 2, 5, 16))
    cotangent = jax.random.normal(jax.random.key(3), x.shape)
    single = _layer_and_grads("ragged_dot", x, cotangent)
    with jax.set_mesh(mesh_lib.make_mesh(f"expert:{n}", jax.devices()[:n])), partition.use_rules(rules_lib.make_rules()):
        sharded = _layer_and_grads("ragged_dot", x, cotangent)
    for g, w in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
