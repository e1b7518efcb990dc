"""Dion2 (optim/dion2.py): NumPy transcription of microsoft/dion's Dion2, the selection, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import math

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np

from optim.dion2 import dion2, scale_by_dion2

POLAR_EXPRESS = [  # microsoft/dion polar_express.py
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def np_polar_express(g, eps=1e-6):
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) * 1.02 + eps)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def np_dion2_direction(*, fraction, ef_decay):
    """``dion2_pre_orthogonalize`` + ``polar_express`` + ``dion2_post_orthogonalize`` on X = W^T."""
    ms = {}

    def direction(key, g, p):
        m = ms.get(key, np.zeros_like(g))
        out, new_m = np.empty_like(g), np.empty_like(g)
        for i in np.ndindex(g.shape[:-2]):
            x = m[i].T + g[i].T  # (fan_out, fan_in)
            rows = x.shape[0] <= x.shape[1]
            slices = x if rows else x.T
            k = max(1, math.ceil(fraction * len(slices)))
            idx = np.argsort(-np.abs(slices).sum(axis=1))[:k]
            u = np.zeros_like(slices)
            u[idx] = np_polar_express(slices[idx])
            slices = slices.copy()
            slices[idx] *= ef_decay
            fan_out, fan_in = x.shape
            out[i] = (np.sqrt(fan_out / fan_in) * (u if rows else u.T)).T
            new_m[i] = (slices if rows else slices.T).T
        ms[key] = new_m
        return out

    return direction


def test_matches_numpy_reference_step_by_step():
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.02, 0.01, 0.1
    tx = dion2(lr, fraction=0.5, ef_decay=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr)
    expected = ref.run_matrix_family(params, grads_seq, np_dion2_direction(fraction=0.5, ef_decay=0.9), lr=lr, adam_lr=adam_lr, wd=wd)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_only_the_selected_slices_of_the_shorter_side_move_and_decay():
    rng = np.random.default_rng(5)
    params = {"wide": jnp.zeros((2, 16, 24)), "tall": jnp.zeros((24, 16))}
    g = jax.tree.map(lambda p: jnp.float32(rng.standard_normal(p.shape)), params)
    tx = scale_by_dion2(fraction=0.25, ef_decay=0.5)
    update, state = jax.jit(tx.update)(g, tx.init(params))
    moved_rows = np.abs(np.asarray(update["wide"])).sum(-1) > 0  # fan_in 16 is X's shorter side: W's rows
    moved_cols = np.abs(np.asarray(update["tall"])).sum(0) > 0  # fan_out 16: W's columns
    assert moved_rows.sum(-1).tolist() == [4, 4] and moved_cols.sum() == 4
    kept = np.asarray(state.mu["tall"]) / np.asarray(g["tall"])
    np.testing.assert_allclose(kept[:, moved_cols], 0.5, rtol=1e-6)
    np.testing.assert_allclose(kept[:, ~moved_cols], 1.0, rtol=1e-6)
    chosen = np.argsort(-np.abs(np.asarray(g["tall"])).sum(0))[:4]
    assert set(chosen) == set(np.flatnonzero(moved_cols))


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(dion2(0.05, fraction=0.5), steps=150) < 0.05
