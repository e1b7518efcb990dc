"""FRUGAL (optim/frugal.py): a NumPy transcription of the authors' GaLore-style projector and
``ProjOptimizer`` step (Adam on the projected gradient, signSGD on the rest, bases and resets every
T steps), the drawn bases, convergence; and of their ``BlockAdamW`` (whole matrices state-full)."""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim.frugal import frugal, frugal_block, scale_by_frugal, scale_by_frugal_block


class NumpyFrugal:
    """One ``m x n`` matrix in the reference's orientation: ``B`` (r x n) on the right when m >= n,
    else ``A`` (m x r) on the left; float64."""

    def __init__(self, shape, *, density, update_gap, projection, state_free, reset, b1=0.9, b2=0.999, eps=1e-8):
        m, n = shape
        self.right = m >= n
        self.rank = max(1, round(density * (n if self.right else m)))
        self.gap, self.projection, self.state_free, self.reset = update_gap, projection, state_free, reset
        self.b1, self.b2, self.eps = b1, b2, eps
        low = (m, self.rank) if self.right else (self.rank, n)
        self.exp_avg, self.exp_avg_sq, self.adam_step, self.t = np.zeros(low), np.zeros(low), 0, 0

    def down(self, g):
        return g @ self.basis.T if self.right else self.basis.T @ g

    def up(self, low):
        return low @ self.basis if self.right else self.basis @ low

    def step(self, g, drawn):
        """``D`` for gradient ``g``; ``drawn``: the optimizer's basis, taken at a refresh of a random
        projection; an SVD's singular vectors take their signs from it (LAPACK's sign is arbitrary)."""
        g = g.astype(np.float64)
        if self.t % self.gap == 0:
            drawn = np.asarray(drawn, np.float64)
            if self.projection == "svd":
                u, _, vh = np.linalg.svd(g, full_matrices=False)
                svd = vh[: self.rank] if self.right else u[:, : self.rank]
                axis = 1 if self.right else 0
                signs = np.sign(np.sum(svd * drawn, axis=axis, keepdims=True))
                assert np.all(np.abs(np.sum(svd * drawn, axis=axis)) > 1 - 1e-4)  # the same singular vectors
                self.basis = svd * signs
            else:
                self.basis = drawn
            if self.reset:
                self.exp_avg, self.exp_avg_sq, self.adam_step = 0 * self.exp_avg, 0 * self.exp_avg_sq, 0
        self.t += 1
        low = self.down(g)
        self.adam_step += 1
        self.exp_avg = self.b1 * self.exp_avg + (1 - self.b1) * low
        self.exp_avg_sq = self.b2 * self.exp_avg_sq + (1 - self.b2) * low * low
        denom = np.sqrt(self.exp_avg_sq) / np.sqrt(1 - self.b2**self.adam_step) + self.eps
        d = self.up(self.exp_avg / (1 - self.b1**self.adam_step) / denom)
        rest = g - self.up(low)
        return d + {"sign_sgd": np.sign(rest), "sgd": rest, "none": 0 * rest}[self.state_free]


SHAPES = {"tall": (2, 12, 8), "wide": (6, 10)}
CASES = [
    {"projection": "svd", "state_free": "sign_sgd", "reset_statistics": True},
    {"projection": "random", "state_free": "sign_sgd", "reset_statistics": True},
    {"projection": "randperm", "state_free": "sign_sgd", "reset_statistics": True},
    {"projection": "svd", "state_free": "sgd", "reset_statistics": False},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_matches_numpy_transcription_step_by_step(case):
    """Seven steps at T = 3: new bases (and resets) at steps 0, 3 and 6; random bases are read from
    the state and given to the transcription."""
    rng = np.random.default_rng(0)
    tx = scale_by_frugal(density=0.25, update_gap=3, **case)
    state = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    refs = {
        (k, i): NumpyFrugal(
            s[-2:], density=0.25, update_gap=3, projection=case["projection"], state_free=case["state_free"],
            reset=case["reset_statistics"],
        )
        for k, s in SHAPES.items()
        for i in np.ndindex(s[:-2])
    }
    update = jax.jit(tx.update)
    for t in range(7):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        updates, state = update(jax.tree.map(jnp.asarray, grads), state)
        for (k, i), numpy_opt in refs.items():
            want = numpy_opt.step(grads[k][i], np.asarray(state.basis[k])[i])
            np.testing.assert_allclose(np.asarray(updates[k])[i], want, rtol=2e-4, atol=2e-5, err_msg=f"{k}{i} step {t}")


def test_bases_are_orthonormal_draws_that_change_at_each_refresh():
    x = {"w": jnp.zeros((16, 12))}
    g = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((16, 12)), jnp.float32)}
    for projection in ("random", "randperm"):
        tx = scale_by_frugal(density=0.25, update_gap=2, projection=projection, seed=3)
        update = jax.jit(tx.update)
        state = tx.init(x)
        bases = []
        for _ in range(3):
            _, state = update(g, state)
            bases.append(np.asarray(state.basis["w"]))
        b = bases[0]
        assert b.shape == (3, 12)
        np.testing.assert_allclose(b @ b.T, np.eye(3), atol=1e-5)
        np.testing.assert_array_equal(bases[0], bases[1])  # kept between refreshes
        assert not np.allclose(bases[1], bases[2])  # a new draw at step 2
        if projection == "randperm":
            assert set(np.unique(b)) == {0.0, 1.0} and len(set(np.argmax(b, axis=1))) == 3
        again = tx.init(x)
        _, again = update(g, again)
        np.testing.assert_array_equal(np.asarray(again.basis["w"]), bases[0])  # the seed decides


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(frugal(1e-2), steps=100) < 0.05


def test_rejects_unknown_projection():
    with pytest.raises(ValueError, match="projection='qr' is not one of svd, random, randperm"):
        frugal(1e-3, projection="qr")


def test_density_must_be_static_under_inject_hyperparams():
    tx = optax.inject_hyperparams(frugal)(learning_rate=1e-3, density=0.5)
    with pytest.raises(ValueError, match="static_args"):
        jax.jit(tx.init)({"w": jnp.zeros((8, 8))})


class NumpyBlockFrugal:
    """The reference's ``BlockOptimizer`` + ``AdamW._compute_update`` over a list of matrices, float64;
    returns the direction (the reference's update divided by ``-lr``)."""

    def __init__(self, n, *, density, update_gap, order, state_free, c=1.0, b1=0.9, b2=0.999, eps=1e-8):
        self.n, self.k, self.gap, self.order, self.state_free, self.c = n, round(n * density), update_gap, order, state_free, c
        self.b1, self.b2, self.eps = b1, b2, eps
        self.state = [{} for _ in range(n)]
        self.next_start = None

    def switch(self, drawn):
        for st in self.state:
            st.clear()
            st.update(step=0, active=False)
        if self.order == "random":
            chosen = drawn
        elif self.order == "ascending":
            self.next_start = 0 if self.next_start is None else self.next_start
            chosen = [(self.next_start + j) % self.n for j in range(self.k)]
            self.next_start += self.k
            if self.next_start >= self.n:
                self.next_start -= self.n
        else:
            self.next_start = self.n - 1 if self.next_start is None else self.next_start
            chosen = [(self.next_start - j) % self.n for j in range(self.k)]
            self.next_start -= self.k
            if self.next_start < 0:
                self.next_start += self.n
        for i in chosen:
            self.state[i].update(step=0, m=0.0, v=0.0, active=True)

    def step(self, grads, drawn):
        """``drawn``: the optimizer's random choice of this step, used where the reference draws one."""
        if "step" not in self.state[0] or self.state[0]["step"] % self.gap == 0:
            self.switch(drawn)
        out = []
        for g, st in zip(grads, self.state, strict=True):
            g = g.astype(np.float64)
            st["step"] += 1
            if st["active"]:
                st["m"] = self.b1 * st["m"] + (1 - self.b1) * g
                st["v"] = self.b2 * st["v"] + (1 - self.b2) * g * g
                denom = np.sqrt(st["v"]) / np.sqrt(1 - self.b2 ** st["step"]) + self.eps
                out.append(st["m"] / (1 - self.b1 ** st["step"]) / denom)
            else:
                out.append({"sign_sgd": self.c * np.sign(g), "sgd": self.c * g, "none": 0 * g}[self.state_free])
        return out


BLOCK_SHAPES = {"sq": (3, 5, 5), "tall": (2, 12, 8), "wide": (6, 10)}  # 6 matrices, in this order


@pytest.mark.parametrize(
    "order,state_free", [("random", "sign_sgd"), ("ascending", "sgd"), ("descending", "none")]
)
def test_block_variant_matches_numpy_transcription_step_by_step(order, state_free):
    """Seven steps at T = 3 with 2 of 6 matrices state-full: switches at steps 0, 3 and 6 (random
    draws read from the state and given to the transcription)."""
    rng = np.random.default_rng(2)
    tx = scale_by_frugal_block(density=0.34, update_gap=3, block_order=order, state_free=state_free, inactive_lr_scale=0.5)
    state = tx.init({k: jnp.zeros(s) for k, s in BLOCK_SHAPES.items()})
    numpy_opt = NumpyBlockFrugal(6, density=0.34, update_gap=3, order=order, state_free=state_free, c=0.5)
    update = jax.jit(tx.update)
    history = []
    for t in range(7):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in BLOCK_SHAPES.items()}
        updates, state = update(jax.tree.map(jnp.asarray, grads), state)
        flags = np.concatenate([np.asarray(a).reshape(-1) for a in jax.tree.leaves(state.active)])
        history.append(np.flatnonzero(flags).tolist())
        matrices = [m for k in BLOCK_SHAPES for m in grads[k].reshape(-1, *BLOCK_SHAPES[k][-2:])]
        want = numpy_opt.step(matrices, history[-1])
        got = [m for k in BLOCK_SHAPES for m in np.asarray(updates[k]).reshape(-1, *BLOCK_SHAPES[k][-2:])]
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6, err_msg=f"matrix {i} step {t}")
    assert all(len(h) == 2 for h in history) and history[0] == history[2] and history[3] != history[6]
    if order != "random":
        assert history[0] == ([0, 1] if order == "ascending" else [4, 5])


def test_block_variant_keeps_adam_state_for_every_matrix_and_converges():
    state = frugal_block(1e-3).init({"blocks": {"mlp": {"up_proj": {"kernel": jnp.zeros((2, 8, 12))}}}})
    inner = state.inner_states["matrix"].inner_state[0]
    assert jax.tree.leaves(inner.mu)[0].shape == (2, 8, 12) and jax.tree.leaves(inner.active)[0].shape == (2,)
    assert ref.regression_loss_ratio(frugal_block(1e-2, density=1.0), steps=100) < 0.05
