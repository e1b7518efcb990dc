"""kernels_pallas.varying: the kernels inside a type-checked `jax.shard_map` (the replica-local train step).

Each replica's gradient is taken inside ``jax.shard_map(..., check_vma=True)`` over the replica axis,
so a kernel's outputs and its `custom_vjp`'s gradients must be typed as varying over that axis like
its inputs. Compiled kernels are checked by lowering for a GPU on this host; interpret mode, which
jax's Pallas interpreter cannot run on such values, must be a clear error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import backends, varying
from kernels_pallas.attention import flash_attention
from kernels_pallas.gmm import api as gmm_api
from kernels_pallas.lightning import api as lightning_api

REPLICAS = 2


def _per_replica(fn, mesh=None):
    """``fn`` per replica inside a type-checked `jax.shard_map` over axis ``data`` (arguments split on axis 0)."""
    mesh = mesh or jax.make_mesh((REPLICAS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"), check_vma=True)), mesh


def _lowers_for_cuda(fn, *abstract):
    with backends.gpu_target((REPLICAS,), ("data",)) as h100s:
        step, _ = _per_replica(fn, h100s)
        return step.trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()


def test_flash_attention_gradients_are_typed_like_their_inputs():
    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, backend="triton").astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    shape = jax.ShapeDtypeStruct((REPLICAS, 128, 4, 64), jnp.bfloat16)
    assert _lowers_for_cuda(grads, shape, shape, shape).count("triton") >= 3  # forward, dQ, dK/dV


def test_gmm_gradients_are_typed_like_their_inputs():
    def grads(lhs, rhs, group_sizes):
        loss = lambda a, b: jnp.sum(gmm_api.gmm(a[0], b[0], group_sizes[0], backend="triton", interpret=False))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(lhs, rhs)

    args = (
        jax.ShapeDtypeStruct((REPLICAS, 64, 64), jnp.bfloat16),
        jax.ShapeDtypeStruct((REPLICAS, 4, 64, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((REPLICAS, 4), jnp.int32),
    )
    assert _lowers_for_cuda(grads, *args).count("__gpu$xla.gpu.triton") == 2  # dlhs, drhs (a sum's gradient needs no forward)


@pytest.mark.devices(REPLICAS)
def test_lightning_attention_runs_per_replica_like_outside():
    """Its scans' carries (the d x d_v state) start as zeros that vary over no axis, and their outputs vary over
    ``data``: the replica-local step with lightning layers failed to trace. The XLA form, forward and gradients."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.float32(rng.standard_normal((REPLICAS, 8, 2, 4)) * 0.3) for _ in range(3))
    slopes = jnp.float32([0.5, 0.1])

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(jnp.sin(lightning_api.lightning_attention(q, k, v, slopes, block=4, implementation="xla")[0]))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    step, mesh = _per_replica(grads)
    with jax.set_mesh(mesh):
        per_replica = step(q, k, v)
    for r in range(REPLICAS):
        whole = grads(q[r : r + 1], k[r : r + 1], v[r : r + 1])
        for got, want in zip(per_replica, whole, strict=True):
            np.testing.assert_allclose(got[r : r + 1], want, rtol=1e-6, atol=1e-6)


@pytest.mark.devices(REPLICAS)
def test_interpret_mode_inside_the_replica_step_names_the_xla_path():
    q = jnp.zeros((REPLICAS, 8, 2, 16), jnp.float32)
    attention, mesh = _per_replica(lambda q: flash_attention(q, q, q, interpret=True))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="interpret mode cannot run .*'data'.*model.attention=xla"):
        attention(q)
    lhs, rhs = jnp.zeros((REPLICAS, 8, 16)), jnp.zeros((REPLICAS, 2, 16, 16))
    sizes = jnp.full((REPLICAS, 2), 4, jnp.int32)
    grouped, _ = _per_replica(lambda a, b, g: gmm_api.gmm(a[0], b[0], g[0], backend="triton", interpret=True)[None])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="model.moe_matmul=ragged_dot"):
        grouped(lhs, rhs, sizes)


def test_interpret_mode_outside_a_shard_map_is_unaffected():
    rng = np.random.default_rng(0)
    q = jnp.float32(rng.standard_normal((1, 8, 2, 16)))
    np.testing.assert_allclose(flash_attention(q, q, q, interpret=True), flash_attention(q, q, q, backend="triton", interpret=True))
    x = jnp.float32(rng.standard_normal((3,)))
    assert varying.varying_axes(x) == frozenset() and varying.unify(x, None)[0] is x
