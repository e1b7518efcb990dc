"""Shampoo (optim/shampoo.py): NumPy reference, grafting, blocking, root failures, sharding, convergence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import blocking
from optim.shampoo import (
    ShampooState,
    root_failures,
    scale_by_shampoo,
    shampoo,
)
from optim.soap import scale_by_soap
from sharding import partition


def np_root(a, p, ridge):
    lam, vecs = np.linalg.eigh(a)
    r = ridge * max(lam[-1], 1e-16)
    return (vecs * (np.maximum(lam, 0) + r) ** (-1.0 / p)) @ vecs.T


def np_shampoo(grads, *, beta1, beta2, nesterov, eps, every, start, graft, graft_beta2=0.999, graft_eps=1e-8, p=4):
    """Single-block Shampoo on one matrix, float64, written from the module docstring's equations."""
    m_rows, n_cols = grads[0].shape
    stat_l, stat_r = eps * np.eye(m_rows), eps * np.eye(n_cols)
    pre_l, pre_r = np.eye(m_rows), np.eye(n_cols)
    mom, nu = np.zeros_like(grads[0]), np.zeros_like(grads[0])
    out = []
    for t, g in enumerate(grads, start=1):
        if graft == "adam":
            nu = graft_beta2 * nu + (1 - graft_beta2) * g * g
            a = g / (np.sqrt(nu / (1 - graft_beta2**t)) + graft_eps)
        elif graft == "rmsprop":
            nu = graft_beta2 * nu + (1 - graft_beta2) * g * g
            a = g / (np.sqrt(nu) + graft_eps)
        elif graft == "adagrad":
            nu = nu + g * g
            a = g / (np.sqrt(nu) + graft_eps)
        else:
            a = g
        w = 1.0 if beta2 == 1.0 else 1.0 - beta2
        stat_l = beta2 * stat_l + w * g @ g.T
        stat_r = beta2 * stat_r + w * g.T @ g
        if t >= start and (t == start or t % every == 0):
            pre_l, pre_r = np_root(stat_l, p, eps), np_root(stat_r, p, eps)
        s = pre_l @ g @ pre_r
        d = s if graft == "none" else s * np.linalg.norm(a) / np.linalg.norm(s)
        if t < start:
            d = a
        mom = beta1 * mom + (1 - beta1) * d
        out.append(beta1 * mom + (1 - beta1) * d if nesterov else mom)
    return out


def run(tx, grads_seq, params):
    state = tx.init(params)
    update = jax.jit(tx.update)
    outs = []
    for grads in grads_seq:
        u, state = update(grads, state, params)
        outs.append(u)
    return outs, state


def random_grads(rng, shape, steps):
    return [rng.normal(size=shape) for _ in range(steps)]


def test_single_block_equals_explicit_inverse_fourth_roots():
    """L^(-1/4) G R^(-1/4) with AdaGrad sums, no graft, no momentum, roots every step."""
    rng = np.random.default_rng(0)
    grads = random_grads(rng, (5, 7), 4)
    tx = scale_by_shampoo(
        block_size=8, beta1=0.0, beta2=1.0, precondition_every=1, start_preconditioning_step=1, graft_type="none"
    )
    params = jnp.zeros((5, 7))
    outs, _ = run(tx, [jnp.asarray(g, jnp.float32) for g in grads], params)
    expected = np_shampoo(grads, beta1=0.0, beta2=1.0, nesterov=False, eps=1e-6, every=1, start=1, graft="none")
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("graft", ["adam", "adagrad"])
def test_matches_numpy_reference_with_graft_momentum_and_ema(graft):
    rng = np.random.default_rng(1)
    grads = random_grads(rng, (6, 4), 6)
    kw = {"beta1": 0.9, "beta2": 0.95, "nesterov": True, "every": 2, "start": 2}
    tx = scale_by_shampoo(
        block_size=8,
        beta1=0.9,
        beta2=0.95,
        nesterov=True,
        precondition_every=2,
        start_preconditioning_step=2,
        graft_type=graft,
        graft_beta2=0.99,
    )
    outs, _ = run(tx, [jnp.asarray(g, jnp.float32) for g in grads], jnp.zeros((6, 4)))
    expected = np_shampoo(grads, eps=1e-6, graft=graft, graft_beta2=0.99, **kw)
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize(
    "graft, optax_graft",
    [
        ("adam", optax.scale_by_adam(b1=0.0, b2=0.99, eps=1e-8)),
        ("rmsprop", optax.scale_by_rms(decay=0.99, eps=1e-8, eps_in_sqrt=False)),
        ("sgd", optax.identity()),
    ],
)
def test_graft_norms_equal_the_graft_optimizer(graft, optax_graft):
    """Per parameter (per layer of a stacked leaf) the update norm is the graft optimizer's."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.zeros((3, 6, 5)), "bias": jnp.zeros((5,))}
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(4)]
    tx = scale_by_shampoo(
        block_size=4, beta1=0.0, precondition_every=1, start_preconditioning_step=1, graft_type=graft, graft_beta2=0.99
    )
    outs, _ = run(tx, grads_seq, params)
    refs, _ = run(optax_graft, grads_seq, params)
    for got, want in zip(outs, refs):
        np.testing.assert_allclose(
            np.linalg.norm(np.asarray(got["w"]).reshape(3, -1), axis=1),
            np.linalg.norm(np.asarray(want["w"]).reshape(3, -1), axis=1),
            rtol=1e-5,
        )
        # 1-D leaves use the graft optimizer alone.
        np.testing.assert_allclose(got["bias"], want["bias"], rtol=1e-5)
        assert not np.allclose(got["w"], want["w"], rtol=1e-2)


def test_blocks_equal_independent_single_block_shampoos():
    """An 8x8 matrix in four 4x4 blocks, and a 10x6 one with ragged edge blocks, equal independent
    single-block Shampoos on the pieces.

    Preconditioning starts at step 3, once every block's statistics have full rank (a 4x2 block's
    4x4 left factor has rank 2 after one gradient). Earlier, the ridge-sized eigenvalues of a
    rank-deficient factor set the inverse root, and float32 eigensolvers on differently batched
    stacks resolve those to different digits (about 1e-3 relative in the update)."""
    rng = np.random.default_rng(3)
    shapes = {"square": (8, 8), "ragged": (10, 6)}
    grads = [{k: rng.normal(size=s) for k, s in shapes.items()} for _ in range(4)]
    kw = {
        "beta1": 0.9,
        "beta2": 0.99,
        "precondition_every": 2,
        "start_preconditioning_step": 3,
        "graft_per_block": True,
        "merge_dims": False,
    }
    to_jax = functools.partial(jax.tree.map, lambda g: jnp.asarray(g, jnp.float32))
    outs, _ = run(scale_by_shampoo(block_size=4, **kw), [to_jax(g) for g in grads], to_jax(grads[0]))
    pieces = {}
    for name, (m, n) in shapes.items():
        for i in range(0, m, 4):
            for j in range(0, n, 4):
                pieces[f"{name}{i}{j}"] = (name, slice(i, min(i + 4, m)), slice(j, min(j + 4, n)))
    assert sum(k.startswith("square") for k in pieces) == 4
    piece_grads = [{k: jnp.asarray(g[name][r, c], jnp.float32) for k, (name, r, c) in pieces.items()} for g in grads]
    refs, _ = run(scale_by_shampoo(block_size=16, **kw), piece_grads, piece_grads[0])
    for got, want in zip(outs, refs):
        for k, (name, r, c) in pieces.items():
            np.testing.assert_allclose(np.asarray(got[name])[r, c], want[k], rtol=1e-4, atol=1e-4)


def test_stacked_layers_are_independent_matrices():
    rng = np.random.default_rng(4)
    grads = random_grads(rng, (3, 6, 4), 3)
    kw = {"precondition_every": 1, "start_preconditioning_step": 1}
    outs, _ = run(scale_by_shampoo(**kw), [jnp.asarray(g, jnp.float32) for g in grads], jnp.zeros((3, 6, 4)))
    layer_grads = [{str(i): jnp.asarray(g[i], jnp.float32) for i in range(3)} for g in grads]
    refs, _ = run(scale_by_shampoo(**kw), layer_grads, {str(i): jnp.zeros((6, 4)) for i in range(3)})
    for got, want in zip(outs, refs):
        for i in range(3):
            np.testing.assert_allclose(np.asarray(got)[i], want[str(i)], rtol=1e-4, atol=1e-4)


def test_root_failure_keeps_previous_preconditioner():
    rng = np.random.default_rng(5)
    params = {"w": jnp.zeros((6, 4)), "v": jnp.zeros((2, 5, 3))}
    tx = scale_by_shampoo(block_size=4, precondition_every=2, start_preconditioning_step=1)
    update = jax.jit(tx.update)
    state = tx.init(params)

    def grads():
        return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)

    _, state = update(grads(), state)  # step 1 computes roots
    assert int(state.root_failures) == 0
    before = jax.tree.map(np.asarray, state.preconds)
    assert any(not np.allclose(v, np.eye(v.shape[-1])) for v in before.values())
    poisoned = blocking.BlockStacks({k: v.at[0, 0, 0].set(jnp.nan) for k, v in state.stats.items()})
    state = state._replace(stats=poisoned)
    u, state = update(grads(), state)  # step 2 refreshes: the poisoned block of each group fails
    assert int(state.root_failures) == len(poisoned)
    for k, v in state.preconds.items():
        np.testing.assert_array_equal(np.asarray(v[0]), before[k][0])
        if v.shape[0] > 1:
            assert not np.array_equal(np.asarray(v[1:]), before[k][1:])
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(u))
    assert int(root_failures({"inner": (state, optax.EmptyState())})) == len(poisoned)


def test_unconverged_newton_roots_are_rejected_and_counted():
    rng = np.random.default_rng(6)
    tx = scale_by_shampoo(
        block_size=4, precondition_every=1, start_preconditioning_step=1, root_method="newton", newton_iters=1
    )
    outs, state = run(tx, [jnp.asarray(g, jnp.float32) for g in random_grads(rng, (8, 4), 2)], jnp.zeros((8, 4)))
    assert int(state.root_failures) == 2 * 4  # 2 steps x 2 row blocks x (L, R)
    (real,) = state.preconds.values()  # 2 L and 2 R
    np.testing.assert_array_equal(np.asarray(real), np.broadcast_to(np.eye(4), (4, 4, 4)))
    assert all(np.all(np.isfinite(np.asarray(u))) for u in outs)


@pytest.mark.devices(8)
def test_sharded_statistics_are_distributed_and_results_match():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"a": jnp.zeros((16, 12)), "b": jnp.zeros((2, 8, 24)), "scale": jnp.zeros((8,))}
    specs = {"a": jax.P("fsdp", None), "b": jax.P(None, None, "fsdp"), "scale": jax.P()}
    rng = np.random.default_rng(8)
    grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]
    tx = scale_by_shampoo(block_size=4, precondition_every=2, start_preconditioning_step=1)
    single, _ = run(tx, grads_seq, params)

    with jax.set_mesh(mesh):
        param_sh = jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs)
        sharded_params = jax.device_put(params, param_sh)
        abstract = blocking.annotate_block_shardings(jax.eval_shape(tx.init, params), mesh)
        state_sh = partition.state_shardings(abstract, params, param_sh, mesh)
        state = jax.jit(tx.init, out_shardings=state_sh)(sharded_params)
        update = jax.jit(tx.update, out_shardings=(param_sh, state_sh))
        outs = []
        for grads in grads_seq:
            u, state = update(jax.device_put(grads, param_sh), state)
            outs.append(u)

    for stacks in (state.stats, state.preconds):
        for v in stacks.values():
            assert partition.per_device_bytes(v) * 8 == v.nbytes
    total = sum(v.nbytes for v in state.stats.values())
    assert partition.per_device_bytes(state.stats) * 8 == total
    assert state.momentum["b"].sharding.spec == jax.P(None, None, "fsdp")
    assert state.graft_nu["a"].sharding.spec == jax.P("fsdp", None)
    for got, want in zip(outs, single):
        for k in params:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-4)


def test_only_hidden_matrices_get_kronecker_factors():
    """The embedding and the norm go to AdamW (jit, inject_hyperparams, sharding: test_common.py)."""
    params = {"w": jnp.zeros((8, 4)), "embed": {"embedding": jnp.zeros((10, 4))}, "norm": jnp.zeros((4,))}
    state = jax.eval_shape(shampoo(1e-2, block_size=4).init, params)
    inner = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ShampooState))]
    (shampoo_state,) = [s for s in inner if isinstance(s, ShampooState)]
    assert sorted(shampoo_state.stats) == ["p4_b4"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="graft_type"):
        scale_by_shampoo(graft_type="lion")
    with pytest.raises(ValueError, match="root_method"):
        scale_by_shampoo(root_method="svd")
    with pytest.raises(ValueError, match="floating-point"):
        scale_by_shampoo().init({"w": jnp.zeros((4, 4), jnp.int32)})
    injected = optax.inject_hyperparams(scale_by_shampoo)(block_size=4)
    state = injected.init({"w": jnp.zeros((4, 4))})
    with pytest.raises(ValueError, match="static_args"):
        jax.jit(injected.update)({"w": jnp.ones((4, 4))}, state)


# Ill-conditioned least squares: min_W ||A W B - Y||^2 / 2 with A, B 8x8 of condition number 100 in
# random bases; the Hessian (B B^T) kron (A^T A) is Kronecker-factored, the case Shampoo and SOAP model.
N = 8
STEPS = 500
TARGET = 1e-4
LRS = (0.01, 0.03, 0.1, 0.3, 1.0)


def least_squares_loss():
    rng = np.random.default_rng(10)

    def ill_conditioned():
        q1, _ = np.linalg.qr(rng.normal(size=(N, N)))
        q2, _ = np.linalg.qr(rng.normal(size=(N, N)))
        return (q1 * np.logspace(0, -2, N)) @ q2.T

    a, b = ill_conditioned(), ill_conditioned()
    y = a @ rng.normal(size=(N, N)) @ b
    a, b, y = (jnp.asarray(x, jnp.float32) for x in (a, b, y))
    loss0 = float(0.5 * jnp.sum(y**2))
    return lambda w: 0.5 * jnp.sum((a @ w @ b - y) ** 2) / loss0


def steps_to_target(direction: optax.GradientTransformation) -> int:
    """Fewest steps to a relative loss below TARGET over the learning rates LRS (STEPS + 1: never)."""
    loss = least_squares_loss()

    def trajectory(lr):
        def step(carry, _):
            w, state = carry
            value, g = jax.value_and_grad(loss)(w)
            u, state = direction.update(g, state, w)
            return (w - lr * u, state), value

        w0 = jnp.zeros((N, N))
        return jax.lax.scan(step, (w0, direction.init(w0)), None, length=STEPS)[1]

    values = np.asarray(jax.jit(jax.vmap(trajectory))(jnp.asarray(LRS)))
    hits = [np.nonzero(v < TARGET)[0] for v in values]
    return min(int(h[0]) if h.size else STEPS + 1 for h in hits)


@functools.cache
def tuned_adam_steps() -> int:
    return min(steps_to_target(optax.scale_by_adam(b1, b2)) for b1, b2 in ((0.9, 0.999), (0.9, 0.99)))


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_ill_conditioned_least_squares_beats_tuned_adam(name):
    if name == "shampoo":  # the original Shampoo's AdaGrad sums, Kronecker factors (no dim merging)
        direction = scale_by_shampoo(
            beta2=1.0, precondition_every=1, start_preconditioning_step=1, merge_dims=False
        )
    else:  # the paper's defaults, basis refreshed every step
        direction = scale_by_soap(precondition_frequency=1)
    ours = steps_to_target(direction)
    assert 2 * ours <= tuned_adam_steps(), (ours, tuned_adam_steps())
