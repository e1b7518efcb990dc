"""Block stacks of Kronecker-factored optimizers: mesh-independent shapes, storage spread, padded computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import blocking
from optim.shampoo import scale_by_shampoo
from optim.soap import scale_by_soap
from sharding import partition

AUTO = jax.sharding.AxisType.Auto


def stacks(state):
    is_stack = lambda x: isinstance(x, blocking.BlockStacks)
    return [v for node in jax.tree.leaves(state, is_leaf=is_stack) if is_stack(node) for v in node.values()]


@pytest.mark.parametrize(
    "shape, mesh_shape, spec",
    [
        ((16, 4, 4), {"fsdp": 8}, jax.P("fsdp", None, None)),  # whole blocks when the count divides
        ((12, 128, 128), {"fsdp": 8}, jax.P(None, "fsdp", None)),  # else rows of every block
        ((12, 128, 128), {"data": 2, "tensor": 4}, jax.P("data", "tensor", None)),
        ((6, 12, 12), {"a": 2, "b": 2, "c": 2}, jax.P("a", ("b", "c"), None)),
        ((3, 4, 4), {"fsdp": 8}, jax.P(None, None, None)),  # nothing divides: replicated
    ],
)
def test_stack_spec_puts_each_axis_on_the_first_dim_it_divides(shape, mesh_shape, spec):
    assert blocking.stack_spec(shape, mesh_shape) == spec


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "make", [lambda: scale_by_shampoo(block_size=8), lambda: scale_by_soap()], ids=["shampoo", "soap"]
)
def test_state_shapes_do_not_depend_on_the_mesh_and_stacks_are_spread(make):
    tx = make()
    params = {"a": jnp.zeros((8, 8)), "b": jnp.zeros((3, 8, 16)), "scale": jnp.zeros((8,))}
    shapes = jax.tree.map(lambda x: x.shape, jax.eval_shape(tx.init, params))
    assert any(v.shape[0] % 8 for v in stacks(jax.eval_shape(tx.init, params)))  # counts 8 devices do not divide
    for mesh_shape, names in (((8,), ("fsdp",)), ((2, 4), ("data", "tensor")), ((1,), ("data",))):
        mesh = jax.make_mesh(mesh_shape, names, axis_types=(AUTO,) * len(names), devices=jax.devices()[: np.prod(mesh_shape)])
        with jax.set_mesh(mesh):
            assert jax.tree.map(lambda x: x.shape, jax.eval_shape(tx.init, params)) == shapes
            abstract = blocking.annotate_block_shardings(jax.eval_shape(tx.init, params), mesh)
            replicated = {k: jax.NamedSharding(mesh, jax.P()) for k in params}
            state = jax.jit(tx.init, out_shardings=partition.state_shardings(abstract, params, replicated, mesh))(params)
        for v in stacks(state):
            assert partition.per_device_bytes([v]) * mesh.size == v.nbytes, (v.shape, v.sharding)


@pytest.mark.devices(8)
def test_spread_blocks_pads_to_the_device_count_and_cuts_back():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4, 4)), jnp.float32)
    seen = []

    def fn(stack):
        seen.append(stack.shape[0])
        return jnp.linalg.inv(stack), jnp.trace(stack, axis1=1, axis2=2)

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AUTO,))
    with jax.set_mesh(mesh):
        inverse, trace = jax.jit(lambda s: blocking.spread_blocks(fn, s))(x)
    assert seen == [8]  # padded with 3 identity blocks, one block per device
    np.testing.assert_allclose(inverse, np.linalg.inv(np.asarray(x)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trace, np.trace(np.asarray(x), axis1=1, axis2=2), rtol=1e-6)
    assert blocking.spread_blocks(fn, x)[0].shape == (5, 4, 4) and seen[-1] == 5  # no mesh: no padding


@pytest.mark.parametrize("make", [scale_by_shampoo, scale_by_soap], ids=["shampoo", "soap"])
def test_matmul_precision_reaches_the_statistics_and_preconditioning_matmuls(make):
    """"auto" keeps full fp32 products on CPU; "high" lowers every block matmul at HIGH precision."""
    params = {"w": jnp.ones((8, 16))}
    kwargs = {"precondition_every": 1, "start_preconditioning_step": 1} if make is scale_by_shampoo else {}

    def block_dot_precisions(precision):
        tx = make(matmul_precision=precision, **kwargs)
        text = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
        return {line.split("precision = [")[1].split("]")[0] for line in text.splitlines() if "dot_general" in line}

    assert block_dot_precisions("auto") == block_dot_precisions("highest") == {"HIGHEST, HIGHEST"}
    assert "HIGH, HIGH" in block_dot_precisions("high")
    with pytest.raises(ValueError, match="matmul_precision must be one of auto, highest, high"):
        make(matmul_precision="fast")


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_map_params_maps_a_state_with_block_stacks(name):
    """issue 34 item 10: blocking.map_params maps each stack's arrays as non-parameter state; optax's own
    (issue 48 item 8) hands ``transform_non_params`` each stack whole."""
    import optax

    from optim import shampoo, soap

    tx = (shampoo.shampoo if name == "shampoo" else soap.soap)(1e-3)
    params = {"w": jnp.ones((2, 8, 12)), "scale": jnp.ones((8,))}
    state = tx.init(params)
    whole = optax.tree.map_params(
        tx, lambda p: "param", state, transform_non_params=lambda x: "other", is_leaf=lambda x: isinstance(x, optax.MaskedNode)
    )
    assert set(jax.tree.leaves(whole)) == {"param", "other"}
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731  # the other group's leaves (optax.partition)
    tag = lambda p, t: p if masked(p) else t  # noqa: E731
    mapped = blocking.map_params(
        tx, tag, state, {"w": "W", "scale": "S"}, transform_non_params=lambda x: "other", is_leaf=masked
    )
    leaves = jax.tree.leaves(mapped)
    assert leaves.count("W") >= 2 and "S" in leaves and set(leaves) == {"W", "S", "other"}
    stacks = [n for n in jax.tree.leaves(mapped, is_leaf=lambda x: isinstance(x, blocking.BlockStacks)) if isinstance(n, blocking.BlockStacks)]
    assert stacks and all(set(s.values()) == {"other"} for s in stacks)
    unchanged = blocking.map_params(tx, lambda p: p, state)
    assert jax.tree.structure(unchanged) == jax.tree.structure(state)
