"""COSMOS (optim/cosmos.py): float64 NumPy transcription of the authors' code, update scale, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import pytest

from optim.cosmos import cosmos, scale_by_cosmos


def np_cosmos_direction(*, b1, b2, eps, rank, gamma, nesterov):
    """github.com/lliu606/COSMOS ``cosmos()`` for one PyTorch (out, in) matrix per (fan_in, fan_out) entry,
    the update before ``-scale * ratio * lr`` and the decay."""
    state = {}

    def one(s, g):
        s["t"] = t = s.get("t", 0) + 1
        s["m"] = b1 * s.get("m", 0.0) + g
        if t == 1:
            u, _, _ = np.linalg.svd(g.T @ g)
            s["p"] = u[:, :rank]
            s["gg"] = (s["p"].T @ g.T) @ (g @ s["p"]) * (1 - b2)
        else:
            old = s["p"].T
            p, _ = np.linalg.qr(b2 * s["p"] @ s["gg"] + (1 - b2) * g.T @ (g @ s["p"]))
            turn = old @ p
            s["p"], s["gg"] = p, b2 * turn.T @ s["gg"] @ turn + (1 - b2) * (g @ p).T @ (g @ p)
        p = s["p"]
        s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * (g @ p) ** 2
        c1, c2 = (1 - b1**t) / (1 - b1), 1 - b2**t
        d = (g + b1 * s["m"]) / (1 + b1 * c1) if nesterov else s["m"] / c1
        adaptive = (d @ p) / (np.sqrt(s["v"]) / np.sqrt(c2) + eps) @ p.T
        rest = ref.newton_schulz(d - (d @ p) @ p.T, "jordan", 5)
        scale = np.sqrt(g.size)
        total = adaptive + gamma * scale * rest / (np.linalg.norm(rest) + eps)
        return scale * total / (np.linalg.norm(total) + eps)

    def direction(key, g, p):
        out = np.empty_like(g)
        for i in np.ndindex(g.shape[:-2]):
            out[i] = one(state.setdefault((key, i), {}), g[i].T).T
        return out

    return direction


# The residual D - D P P^T is rank-deficient (at step 1 D = G, whose row space P partly spans), and
# Newton-Schulz lifts its zero singular values' fp32 rounding (~1e-6 of ||G||) by up to a^5 = 490
# (Jordan's a = 3.4445): ~8e-4 of the first update where gamma > 0, none without the Muon part.
# nesterov=False (M_t / c_t) is ours: the authors' COSMOS_optim.py has only the Nesterov form.
CASES = [(0.0, True, 3e-6), (0.2, False, 1e-4)]  # atol on parameters of scale 0.1; 3e-6: eigh / QR subspace in fp32


@pytest.mark.parametrize("gamma, nesterov, atol", CASES, ids=["adaptive-part-nesterov", "with-newton-schulz"])
def test_matches_numpy_transcription_step_by_step(gamma, nesterov, atol):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    direction = np_cosmos_direction(b1=0.9, b2=0.95, eps=1e-8, rank=3, gamma=gamma, nesterov=nesterov)
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = cosmos(lr, b1=0.9, b2=0.95, rank=3, gamma=gamma, nesterov=nesterov, weight_decay=wd, adam_lr_ratio=adam_lr / lr)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected, atol=atol)


def test_update_has_rms_1_and_a_full_rank_subspace_has_no_newton_schulz_part():
    """``U`` has RMS 1 per matrix. At rank >= fan_in the complement is empty (the authors' code would
    orthogonalise the rounding error of D - D P P^T there): the first update is then exactly
    ``sign(G P) P^T``, so ``U P`` is +-1."""
    rng = np.random.default_rng(1)
    g = {"w": jnp.float32(rng.standard_normal((3, 16, 24))), "full": jnp.float32(rng.standard_normal((4, 10)))}
    tx = scale_by_cosmos(rank=5)
    state = tx.init(g)
    update = jax.jit(tx.update)
    u, state = update(g, state)
    p = np.asarray(state.basis["full"], np.float64)
    np.testing.assert_allclose(np.abs(np.asarray(u["full"], np.float64).T @ p), 1.0, rtol=1e-4)  # eps beside |G P|
    u, state = update(g, state)
    for leaf in ("w", "full"):
        rms = np.sqrt(np.mean(np.square(np.asarray(u[leaf], np.float64)), axis=(-2, -1)))
        np.testing.assert_allclose(rms, 1.0, rtol=1e-5)
    assert state.basis["w"].shape == (3, 16, 5) and state.gram["w"].shape == (3, 5, 5)
    assert state.nu["w"].shape == (3, 24, 5) and state.basis["full"].shape == (4, 4)
    p = np.asarray(state.basis["w"], np.float64)
    np.testing.assert_allclose(np.swapaxes(p, 1, 2) @ p, np.broadcast_to(np.eye(5), (3, 5, 5)), atol=1e-5)


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(cosmos(0.05, rank=4)) < 0.05

