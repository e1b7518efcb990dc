"""SOAP-Muon (optim/soap_muon.py): NumPy transcription of the modded-nanogpt record's step, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax

from optim.soap_muon import scale_by_soap_muon, soap_muon


class NpSoapMuon:
    """float64 transcription for one matrix of modded-nanogpt's track-3 record #46 (f411b3d): Muon's
    Nesterov EMA momentum, ``soap_precondition_momentum`` (second moment of the rotated direction,
    ``max(V, eps^2)^(1/2)``; its norm rescale is a factor Newton-Schulz removes), Newton-Schulz, then
    ``soap_update_preconditioner`` (Gram EMAs, eigh at the first call, sorted power-QR after)."""

    def __init__(self, shape, beta=0.95, b2=0.9, eps=1e-8, freq=1):
        self.beta, self.b2, self.eps, self.freq = beta, b2, eps, freq
        self.grams = [np.zeros((d, d)) for d in shape]
        self.bases = None
        self.m, self.v, self.calls = np.zeros(shape), np.zeros(shape), 0

    def __call__(self, g):
        self.m = self.beta * self.m + (1 - self.beta) * g
        d = self.beta * self.m + (1 - self.beta) * g
        if self.bases is not None:
            ql, qr = self.bases
            p = ql.T @ d @ qr
            self.v = self.b2 * self.v + (1 - self.b2) * p * p
            d = ql @ (p / np.sqrt(np.maximum(self.v, self.eps**2))) @ qr.T
        out = ref.shape_scale(g.shape, "moonlight") * ref.orthogonalize(d)
        outer = [g @ g.T, g.T @ g]
        self.grams = [self.b2 * s + (1 - self.b2) * o for s, o in zip(self.grams, outer, strict=True)]
        if self.bases is None:
            self.bases = [np.linalg.eigh(s)[1][:, ::-1] for s in self.grams]
        elif self.calls > 0 and self.calls % self.freq == 0:
            new = []
            for axis, (s, q) in enumerate(zip(self.grams, self.bases, strict=True)):
                order = np.argsort(-np.diag(q.T @ s @ q))
                self.v = np.take(self.v, order, axis=axis)
                new.append(np.linalg.qr(s @ q[:, order])[0])
            self.bases = new
        self.calls += 1
        return out


def test_matches_numpy_transcription_step_by_step():
    """Square matrices: the first Gram EMAs are full rank, so their eigenbases are unique up to signs
    (which cancel); a non-square one's null space has no preferred basis. 5 steps, rtol 1e-5 and atol
    5e-5 on updates of scale ~0.4: fp32 eigh / QR and Newton-Schulz of the whitened matrices (at the
    second step a sign matrix, ``D' / sqrt(V) = sign(D') / sqrt(1 - b2)``) leave 1e-6 to 4e-5 (plain
    Muon at step 1: 5e-7); a wrong rule is off by 1e-2 or more."""
    rng = np.random.default_rng(0)
    shapes = {"w": (8, 8), "stack": (2, 6, 6)}
    grads_seq = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(5)]
    tx = scale_by_soap_muon(precondition_frequency=2)
    refs = {k: [NpSoapMuon(s[-2:], freq=2) for _ in range(int(np.prod(s[:-2])))] for k, s in shapes.items()}
    state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
    step = jax.jit(tx.update)
    for grads in grads_seq:
        updates, state = step(jax.tree.map(jnp.float32, grads), state)
        for k, s in shapes.items():
            flat = grads[k].reshape(-1, *s[-2:])
            expected = np.stack([r(g) for r, g in zip(refs[k], flat, strict=True)]).reshape(s)
            np.testing.assert_allclose(np.asarray(updates[k], np.float64), expected, rtol=1e-5, atol=5e-5)


def test_converges_on_minibatch_regression():
    """Minibatch gradients: on a full-batch regression the eigenbasis diagonalises the gradient, and the
    element-wise second moment blows its rounding-level off-diagonal entries up to O(1) (the method
    assumes gradient noise there, as in language-model training)."""
    rng = np.random.default_rng(0)
    x = jnp.float32(rng.standard_normal((512, 16)))
    y = x @ jnp.float32(rng.standard_normal((16, 24)) / 4) + 0.5 + 0.1 * jnp.float32(rng.standard_normal((512, 24)))
    params = {"w": jnp.zeros((16, 24)), "bias": jnp.zeros(24)}
    tx = soap_muon(0.1)

    def loss(p, xb, yb):
        return jnp.mean(jnp.square(xb @ p["w"] + p["bias"] - yb))

    @jax.jit
    def step(p, state, i):
        rows = jax.random.choice(jax.random.key(i), 512, (16,), replace=False)
        updates, state = tx.update(jax.grad(loss)(p, x[rows], y[rows]), state, p)
        return optax.apply_updates(p, updates), state

    state, start = tx.init(params), loss(params, x, y)
    for i in range(60):
        params, state = step(params, state, i)
    assert loss(params, x, y) / start < 0.25
