"""SOAP (optim/soap.py) against a NumPy transcription of the pinned reference step, and sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import blocking, spec
from optim.soap import Soap, SoapState, scale_by_soap, soap
from sharding import partition


class NumpySoap:
    """float64 transcription of SOAP.step of github.com/nikhilvyas/SOAP@a1e5535 for one matrix or vector.

    Returns the direction ``-(p_new - p_old) / lr`` without weight decay; keeps the reference's
    every-step round trip of ``exp_avg`` through the original space.
    """

    def __init__(self, shape, b1=0.95, b2=0.95, eps=1e-8, freq=10, max_precond_dim=10000):
        self.b1, self.b2, self.eps, self.freq = b1, b2, eps, freq
        self.gg = [np.zeros((d, d)) if d <= max_precond_dim else None for d in shape]
        self.q = None
        self.exp_avg = np.zeros(shape)
        self.exp_avg_sq = np.zeros(shape)
        self.step = 0

    def project(self, x):
        for q in self.q:
            x = np.tensordot(x, q, axes=([0], [0])) if q is not None else np.moveaxis(x, 0, -1)
        return x

    def project_back(self, x):
        for q in self.q:
            x = np.tensordot(x, q, axes=([0], [1])) if q is not None else np.moveaxis(x, 0, -1)
        return x

    def update_preconditioner(self, g):
        if self.q is not None:
            self.exp_avg = self.project_back(self.exp_avg)
        for idx, gg in enumerate(self.gg):
            if gg is not None:
                other = [j for j in range(g.ndim) if j != idx]  # none for a vector: its outer product
                outer = np.tensordot(g, g, axes=(other, other))
                gg += (1 - self.b2) * (outer - gg)  # torch lerp_(outer, 1 - shampoo_beta)
        if self.q is None:
            self.q = [None if gg is None else np.linalg.eigh(gg)[1][:, ::-1] for gg in self.gg]
        if self.step > 0 and self.step % self.freq == 0:
            new_q = []
            for ind, (gg, q) in enumerate(zip(self.gg, self.q)):
                if gg is None:
                    new_q.append(None)
                    continue
                est = np.diag(q.T @ gg @ q)
                order = np.argsort(-est, kind="stable")
                self.exp_avg_sq = np.take(self.exp_avg_sq, order, axis=ind)
                new_q.append(np.linalg.qr(gg @ q[:, order])[0])
            self.q = new_q
        if self.step > 0:
            self.exp_avg = self.project(self.exp_avg)

    def __call__(self, g):
        if self.q is None:
            self.update_preconditioner(g)
            return np.zeros_like(g)
        g_rot = self.project(g)
        self.step += 1
        self.exp_avg = self.b1 * self.exp_avg + (1 - self.b1) * g_rot
        self.exp_avg_sq = self.b2 * self.exp_avg_sq + (1 - self.b2) * g_rot**2
        denom = np.sqrt(self.exp_avg_sq) + self.eps
        scale = np.sqrt(1 - self.b2**self.step) / (1 - self.b1**self.step)
        direction = scale * self.project_back(self.exp_avg / denom)
        self.update_preconditioner(g)
        return direction


def run(tx, grads_seq, params):
    state = tx.init(params)
    update = jax.jit(tx.update)
    outs = []
    for grads in grads_seq:
        u, state = update(grads, state, params)
        outs.append(u)
    return outs, state


@pytest.mark.parametrize("shape, max_precond_dim", [((5, 5), 10000), ((4, 7), 6)])
def test_matches_numpy_reference_step_by_step(shape, max_precond_dim):
    """Square (both sides rotated) and one side above max_precond_dim; 3 basis refreshes in 8 steps."""
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=shape) for _ in range(8)]
    ref = NumpySoap(shape, freq=2, max_precond_dim=max_precond_dim)
    expected = [ref(g) for g in grads]
    tx = scale_by_soap(precondition_frequency=2, max_precond_dim=max_precond_dim)
    outs, state = run(tx, [jnp.asarray(g, jnp.float32) for g in grads], jnp.zeros(shape))
    np.testing.assert_array_equal(np.asarray(outs[0]), 0.0)
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    # The stored moments are the reference's (both in the rotated space, up to column signs of Q).
    np.testing.assert_allclose(np.asarray(state.nu), ref.exp_avg_sq, rtol=1e-3, atol=1e-6)
    assert sorted(state.stats) == sorted({f"b{d}" for d in shape if d <= max_precond_dim})


def test_unrotated_parameters_get_adam():
    """1-D leaves (without precondition_1d) get Adam with the reference's eps-outside bias correction."""
    rng = np.random.default_rng(1)
    grads = [{"b": jnp.asarray(rng.normal(size=(6,)), jnp.float32)} for _ in range(4)]
    outs, _ = run(scale_by_soap(b1=0.9, b2=0.99), grads, {"b": jnp.zeros((6,))})
    refs, _ = run(optax.scale_by_adam(b1=0.9, b2=0.99, eps=0.0), grads[1:], {"b": jnp.zeros((6,))})
    np.testing.assert_array_equal(np.asarray(outs[0]["b"]), 0.0)
    for got, want in zip(outs[1:], refs):
        np.testing.assert_allclose(got["b"], want["b"], rtol=1e-4)


def test_precondition_1d_rotates_a_vector_like_the_reference():
    """``precondition_1d``: a vector gets one ``(n, n)`` statistic and is rotated like a matrix's side.

    The statistic of ``k`` vector gradients has rank ``k``: until it has full rank, the basis its
    eigendecomposition or QR refresh gives is arbitrary on the null space (LAPACK's choice, in the
    reference as here), so the reference takes this one's basis until then, and its own after."""
    n, rng = 6, np.random.default_rng(3)
    grads = [rng.normal(size=(n,)) for _ in range(14)]
    ref = NumpySoap((n,), freq=2)
    tx = scale_by_soap(precondition_frequency=2, precondition_1d=True)
    state, update = tx.init(jnp.zeros((n,))), jax.jit(tx.update)
    for g in grads:
        got, state = update(jnp.asarray(g, jnp.float32), state, jnp.zeros((n,)))
        want = ref(g)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
        if np.linalg.matrix_rank(ref.gg[0]) < n:
            ref.q = [np.asarray(state.bases[f"b{n}"][0], np.float64)]
    assert sorted(state.stats) == [f"b{n}"]


def test_the_registry_soap_refuses_precondition_1d():
    """Its 1-D parameters take AdamW, so the flag would be ignored: an error naming the way to rotate them."""
    assert "precondition_1d" not in spec.config_defaults(Soap)
    with pytest.raises(ValueError, match="scale_by_soap"):
        soap(3e-3, precondition_1d=True)


def test_stacked_layers_are_independent_matrices():
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=(2, 4, 3)) for _ in range(4)]
    tx = scale_by_soap(precondition_frequency=2)
    outs, _ = run(tx, [jnp.asarray(g, jnp.float32) for g in grads], jnp.zeros((2, 4, 3)))
    layer_grads = [{str(i): jnp.asarray(g[i], jnp.float32) for i in range(2)} for g in grads]
    refs, _ = run(tx, layer_grads, {str(i): jnp.zeros((4, 3)) for i in range(2)})
    for got, want in zip(outs, refs):
        for i in range(2):
            np.testing.assert_allclose(np.asarray(got)[i], want[str(i)], rtol=1e-4, atol=1e-4)


@pytest.mark.devices(8)
def test_sharded_statistics_are_distributed_and_results_match():
    """Square blocks, so the first gradient alone gives full-rank statistics: SOAP's initial eigenbasis
    is then unique up to signs (which cancel). With a 16x8 gradient the 16x16 statistic has rank 8,
    half of its eigenbasis is arbitrary, and single-device and sharded eigendecompositions may pick
    different bases, and so different (equally valid) updates."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"a": jnp.zeros((16, 16)), "b": jnp.zeros((2, 16, 16)), "scale": jnp.zeros((8,))}
    specs = {"a": jax.P("fsdp", None), "b": jax.P(None, None, "fsdp"), "scale": jax.P()}
    rng = np.random.default_rng(3)
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    tx = soap(1e-2, precondition_frequency=2)
    single, _ = run(tx, grads_seq, params)

    with jax.set_mesh(mesh):
        param_sh = jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs)
        abstract = blocking.annotate_block_shardings(jax.eval_shape(tx.init, params), mesh)
        state_sh = partition.state_shardings(abstract, params, param_sh, mesh)
        state = jax.jit(tx.init, out_shardings=state_sh)(jax.device_put(params, param_sh))
        update = jax.jit(tx.update, out_shardings=(param_sh, state_sh))
        outs = []
        for grads in grads_seq:
            u, state = update(jax.device_put(grads, param_sh), state, jax.device_put(params, param_sh))
            outs.append(u)

    soap_states = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, SoapState))]
    (inner,) = [s for s in soap_states if isinstance(s, SoapState)]
    for stacks in (inner.stats, inner.bases):
        for v in stacks.values():
            assert partition.per_device_bytes(v) * 8 == v.nbytes
    assert inner.nu["b"].sharding.spec == jax.P(None, None, "fsdp")
    for got, want in zip(outs, single):
        for k in params:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-5)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="max_precond_dim"):
        scale_by_soap(max_precond_dim=0)
    with pytest.raises(ValueError, match="floating-point"):
        scale_by_soap().init({"w": jnp.zeros((4, 4), jnp.int32)})
