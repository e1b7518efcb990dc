"""Drop-Muon (optim/drop_muon.py): NumPy transcription of the paper's step given the drawn layers,
the draw's distribution, the Newton-Schulz products per step counted in the compiled HLO, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import collections
import math
import re

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np

from optim.drop_muon import drop_muon, scale_by_drop_muon

LAYERS = 3


def drawn_start(seed, step, depth):
    """The first active layer of ``step``: uniform on {0, ..., depth - 1} from (seed, step)."""
    return int(jax.random.randint(jax.random.fold_in(jax.random.key(seed), step), (), 0, depth))


def np_drop_muon_direction(*, beta, wd, seed, depth):
    """Gruntkowska et al. (arXiv:2510.02239): layers i >= s_k take Muon's step, the others keep weights
    and momentum. Stacked leaves ``(layers, fan_in, fan_out)``; returns ``d`` with ``-lr (d + wd W)``
    the step, so a frozen layer's ``d`` is ``-wd W`` (a zero step)."""
    mus, steps = {}, collections.Counter()

    def direction(key, g, p):
        start = drawn_start(seed, steps[key], depth)
        steps[key] += 1
        mu = mus.get(key, np.zeros_like(g))
        d, new_mu = ref.momentum(g, mu, beta, "ema", True)
        out = ref.shape_scale(p.shape, "moonlight") * ref.orthogonalize(d)
        if p.ndim == 3:
            frozen = np.arange(p.shape[0]) < start
            new_mu[frozen] = mu[frozen]
            out[frozen] = -wd * p[frozen]
        mus[key] = new_mu
        return out

    return direction


def test_matches_numpy_reference_step_by_step():
    rng = np.random.default_rng(0)
    params = ref.f32(
        jax.tree.map(
            lambda shape: 0.1 * rng.standard_normal(shape),
            {
                "embed": {"embedding": (11, 8)},
                "blocks": {"attn": {"q_proj": {"kernel": (LAYERS, 8, 8)}}, "mlp": {"down_proj": {"kernel": (LAYERS, 12, 8)}}},
                "mlp_out": {"kernel": (8, 12)},  # a hidden matrix outside the stack: every step
                "final_norm": {"scale": (8,)},
            },
            is_leaf=lambda x: isinstance(x, tuple),
        )
    )
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd, seed = 0.05, 0.01, 0.1, 3
    direction = np_drop_muon_direction(beta=0.9, wd=wd, seed=seed, depth=LAYERS)
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = drop_muon(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, seed=seed)
    actual = ref.run_jax(tx, params, grads_seq)
    ref.assert_trees_close(actual, expected)
    starts = [drawn_start(seed, t, LAYERS) for t in range(len(grads_seq))]
    assert len(set(starts)) > 1, starts  # the compared steps froze different layers
    q = [np.asarray(a["blocks"]["attn"]["q_proj"]["kernel"]) for a in [params, *actual]]
    for t, s in enumerate(starts):  # frozen layers kept their weights exactly, the others moved
        np.testing.assert_array_equal(q[t + 1][:s], q[t][:s])
        assert np.all(np.abs(q[t + 1][s:] - q[t][s:]).max(axis=(1, 2)) > 0)


def test_start_layer_is_uniform():
    draws = jax.vmap(lambda t: jax.random.randint(jax.random.fold_in(jax.random.key(0), t), (), 0, 4))(jnp.arange(400))
    assert [drawn_start(0, t, 4) for t in range(3)] == list(np.asarray(draws[:3]))
    counts = np.bincount(np.asarray(draws), minlength=4)
    assert counts.min() > 70 and counts.max() < 130, counts  # 100 each


def dot_matrices(hlo):
    """How many matrices each dot of the compiled program multiplies (its batch size), counted."""
    out = collections.Counter()
    for shape in re.findall(r"= f32\[([\d,]+)\][^\n]*? dot\(", hlo):
        dims = [int(x) for x in shape.split(",")]
        out[math.prod(dims[:-2])] += 1
    return out


def test_compiled_step_orthogonalizes_only_the_active_layers():
    """One switch branch per start layer j, each with Jordan's 5 x 3 products on the b - j active
    matrices: a step costs (b - s_k) / b of Muon's, (b + 1) / (2 b) in expectation."""
    depth = 4
    tx = scale_by_drop_muon(shape_scale="jordan")
    params = {"w": jnp.ones((depth, 8, 16))}
    hlo = jax.jit(tx.update).lower(params, tx.init(params)).compile().as_text()
    assert dot_matrices(hlo) == {layers: 15 for layers in range(1, depth + 1)}


def test_converges_on_matrix_regression():
    rng = np.random.default_rng(0)
    x = jnp.float32(rng.standard_normal((64, 16)))
    y = x @ jnp.float32(rng.standard_normal((16, 24)) / 4)
    params = {"w": jnp.zeros((2, 16, 24))}  # two independent regressions as a stack of layers
    tx = drop_muon(0.05, weight_decay=0.0)

    def loss(p):
        return jnp.mean(jnp.square(jnp.einsum("bi,lio->lbo", x, p["w"]) - y))

    @jax.jit
    def step(p, s):
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return jax.tree.map(jnp.add, p, u), s

    state, first = tx.init(params), float(loss(params))
    for _ in range(80):
        params, state = step(params, state)
    assert float(loss(params)) < 0.05 * first
