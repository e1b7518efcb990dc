"""sharding.partition.logical_shard_map: per-shard kernels with specs from the logical rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

QKV = ("batch", "seq", "heads", "head_dim")


def _per_head_sum(x):
    """Needs whole sequences: a sum over seq; and a max over the batch, reduced over the batch's mesh axes."""
    head_max = jnp.max(x, axis=(0, 1, 3))
    batch_axes = partition.logical_mesh_axes("batch")
    if batch_axes:
        head_max = jax.lax.pmax(head_max, batch_axes)
    return jnp.sum(x, axis=1, keepdims=True) + 0 * x, head_max


def _sharded(fn=_per_head_sum):
    return partition.logical_shard_map(fn, [QKV], (QKV, ("heads",)), whole=("seq",))


def test_without_a_mesh_the_function_runs_as_is():
    x = jnp.arange(2 * 3 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 4, 2)
    out, _ = _sharded()(x)
    np.testing.assert_array_equal(out, _per_head_sum(x)[0])


@pytest.mark.devices(8)
def test_each_shard_sees_its_batch_and_heads_and_whole_sequences():
    seen = []

    def record(x):
        seen.append(x.shape)
        return _per_head_sum(x)

    x = jax.random.normal(jax.random.key(0), (4, 6, 4, 8))
    with jax.set_mesh(mesh_lib.make_mesh("data:2,fsdp:2,tensor:2")), partition.use_rules(rules_lib.make_rules("tp")):
        out, head_max = jax.jit(_sharded(record))(x)
        assert partition.logical_mesh_axes("batch") == ("data", "fsdp")
        assert partition.logical_mesh_axes("heads") == ("tensor",)
    assert seen == [(1, 6, 2, 8)]
    expected_out, expected_max = _per_head_sum(x)
    np.testing.assert_allclose(out, expected_out, rtol=1e-6)
    np.testing.assert_array_equal(head_max, expected_max)
    assert out.sharding.spec == jax.P(("data", "fsdp"), None, "tensor")


@pytest.mark.devices(8)
def test_a_sharded_sequence_is_an_error_that_names_the_fix():
    x = jnp.zeros((4, 8, 4, 8))
    mesh, rules = mesh_lib.make_mesh("data:2,seq:2,tensor:2"), rules_lib.make_rules("sp")
    with jax.set_mesh(mesh), partition.use_rules(rules), pytest.raises(ValueError, match="'seq' whole.*rule_overrides='seq='"):
        jax.jit(_sharded())(x)


@pytest.mark.devices(8)
def test_a_dimension_that_does_not_split_is_an_error():
    x = jnp.zeros((4, 8, 4, 8))
    mesh, rules = mesh_lib.make_mesh("data:1,tensor:8"), rules_lib.make_rules("tp")
    message = r"dimension 2 \('heads', 4\) does not split over mesh axes \('tensor',\) of size 8"
    with jax.set_mesh(mesh), partition.use_rules(rules), pytest.raises(ValueError, match=message):
        jax.jit(_sharded())(x)
