"""Scion (optim/scion.py): NumPy transcription of the paper and the reference code, roles, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim.scion import scion, scion_labels


def np_lmo(role, m, *, radius, embedding_radius, head_radius, vector_radius, spectral_max):
    """github.com/LIONS-EPFL/scion's norms on the repo's (fan_in, fan_out) = PyTorch's (d_in, d_out)^T."""
    if role == "spectral":
        s = np.sqrt(m.shape[-1] / m.shape[-2])
        return radius * (max(1.0, s) if spectral_max else s) * ref.orthogonalize(m)
    if role == "embedding":  # ColNorm(transpose=True) on a (vocab, width) table
        return embedding_radius * m / (np.linalg.norm(m, axis=-1, keepdims=True) / np.sqrt(m.shape[-1]) + 1e-8)
    if role == "head":  # Sign(normalized=True): 1 / d_in
        return head_radius * np.sign(m) / m.shape[-2]
    return vector_radius * m / (np.sqrt(np.mean(m * m, axis=-1, keepdims=True)) + 1e-8)  # BiasRMS


def np_scion(params, grads_seq, *, lr, momentum, constrained, **radii):
    roles = jax.tree.leaves(scion_labels(params))
    values = jax.tree.leaves(params)
    treedef = jax.tree.structure(params)
    bufs = [np.zeros_like(p) for p in values]
    history = []
    for grads in grads_seq:
        new = []
        for i, (role, p, g) in enumerate(zip(roles, values, jax.tree.leaves(grads), strict=True)):
            bufs[i] = (1 - momentum) * bufs[i] + momentum * g
            update = np_lmo(role, bufs[i], **radii)
            new.append(((1 - lr) * p if constrained else p) - lr * update)
        values = new
        history.append(treedef.unflatten(values))
    return history


def test_labels_route_each_role():
    params = ref.model_tree(0, untied=True)
    roles = scion_labels(params)
    assert roles["embed"]["embedding"] == "embedding" and roles["lm_head"]["kernel"] == "head"
    assert roles["blocks"]["attn"]["q_proj"]["kernel"] == "spectral"
    assert roles["blocks"]["attn_norm"]["scale"] == "vector" and roles["final_norm"]["scale"] == "vector"


CASES = [
    {"constrained": True, "spectral_max": True, "momentum": 0.1},
    {"constrained": False, "spectral_max": False, "momentum": 1.0},
]


@pytest.mark.parametrize("case", CASES, ids=["constrained-max", "unconstrained-no-momentum"])
def test_matches_numpy_reference_step_by_step(case):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    radii = {"radius": 2.0, "embedding_radius": 0.5, "head_radius": 4.0, "vector_radius": 0.25}
    lr = 0.02
    expected = np_scion(params, grads_seq, lr=lr, **case, **radii)
    tx = scion(lr, ns_batching="none", **case, **radii)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_constrained_iterates_stay_in_the_ball():
    """Frank-Wolfe: from inside the ball, every iterate stays inside (sign LMO: max-norm rho / fan_in)."""
    rng = np.random.default_rng(3)
    params = {"lm_head": {"kernel": jnp.zeros((8, 16))}}
    tx = scion(0.3, head_radius=4.0)
    state = tx.init(params)
    for t in range(20):
        g = {"lm_head": {"kernel": jnp.float32(rng.standard_normal((8, 16)) * 10)}}
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    assert float(jnp.abs(params["lm_head"]["kernel"]).max()) <= 4.0 / 8 * (1 + 1e-6)


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(scion(0.05, momentum=0.5, constrained=False, radius=1.0)) < 0.05
