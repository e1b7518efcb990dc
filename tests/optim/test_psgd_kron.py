"""PSGD-Kron (optim/psgd_kron.py): pytorch-optimizer's ``Kron`` step by step (when a Python with torch is
given), a float64 NumPy transcription, the update schedule, rebalancing, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim import psgd_kron as kron

# A Python with torch and pytorch_optimizer for the reference comparison (e.g. a separate venv).
TORCH_PYTHON = os.environ.get("SPMDLAB_TORCH_PYTHON", sys.executable)
TORCH_SCRIPT = pathlib.Path(__file__).with_name("kron_torch_reference.py")
STEPS = 6


def tree(seed, shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: np.float32(scale * rng.standard_normal(s)).astype(np.float64) for k, s in shapes.items()}


def kron_state(state):
    return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kron.KronState)) if isinstance(s, kron.KronState))


def run_jax(tx, params, grads_seq):
    """Parameters after each step and the noise `kron.noise` drew for each step (float64 NumPy)."""
    params = jax.tree.map(jnp.float32, params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    out, noises = [], []
    for t, grads in enumerate(grads_seq):
        grads = jax.tree.map(jnp.float32, grads)
        noises.append(jax.tree.map(np.asarray, kron.noise(kron_state(state).key, t + 1, grads)))
        params, state = step(params, state, grads)
        out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), params))
    return out, noises


def norm_lower_bound(a):
    """The reference's spectral-norm lower bound: one power step from the heaviest column or row."""
    top = np.max(np.abs(a))
    a = a / top if top > 0 else a
    col, row = np.sum(a * a, axis=0), np.sum(a * a, axis=1)
    x0 = a[:, np.argmax(col)] @ a
    x1 = a @ a[np.argmax(row)]
    if col.max() > row.max():
        return top * np.linalg.norm((x0 / np.linalg.norm(x0)) @ a.T)
    return top * np.linalg.norm(a.T @ (x1 / np.linalg.norm(x1)))


class NpKron:
    """Li's PSGD-Kron for one tensor of at most two dims, float64 (pytorch-optimizer ``Kron.step``)."""

    def __init__(self, shape, *, triangular, scale=1.0, beta=0.9, lr_p=0.1):
        self.shape = shape or (1,)
        k = len(self.shape)
        self.qs = [scale ** (1 / k) * (np.eye(n) if tri else np.ones(n)) for n, tri in zip(self.shape, triangular, strict=True)]
        self.m, self.t, self.beta, self.lr_p = 0.0, 0, beta, lr_p

    def mats(self):
        return [q if q.ndim == 2 else np.diag(q) for q in self.qs]

    def fit(self, g, v, damping=False):
        g, v = g.reshape(self.shape), v.reshape(self.shape)
        if damping:  # kron_torch's _calc_A_and_conjB: G += sqrt(eps_f32) * mean|G| * V
            g = g + np.sqrt(np.finfo(np.float32).eps) * np.mean(np.abs(g)) * v
        if len(self.shape) == 1:
            (q,) = self.qs
            a, b = q * g, v / q
            self.qs = [q - self.lr_p * (a * a - b * b) * q / np.max(np.abs(a * a + b * b))]
            return
        q1, q2 = self.mats()
        a = q1 @ g @ q2.T
        b = np.linalg.inv(q1).T @ v @ np.linalg.inv(q2)
        pairs = [(a @ a.T, b @ b.T), (a.T @ a, b.T @ b)]
        new = []
        for q, (t1, t2) in zip(self.qs, pairs, strict=True):
            if q.ndim == 1:
                d1, d2 = np.diag(t1), np.diag(t2)
                new.append(q - self.lr_p * (d1 - d2) * q / np.max(np.abs(d1 + d2)))
            else:
                new.append(q - self.lr_p * np.triu(t1 - t2) / norm_lower_bound(t1 + t2) @ q)
        self.qs = new

    def precondition(self, g):
        if len(self.shape) == 1:
            d = self.qs[0] ** 2 * g.reshape(self.shape)
        else:
            q1, q2 = self.mats()
            d = q1.T @ q1 @ g @ q2.T @ q2
        return (d * min(1.1 / (np.sqrt(np.mean(d * d)) + 1e-6), 1.0)).reshape(g.shape)

    def momentum(self, g):
        self.t += 1
        self.m = self.beta * self.m + (1 - self.beta) * g
        return self.m / (1 - self.beta**self.t)


def np_kron_run(params, grads_seq, noises, *, lr, wd, prob, momentum_into, triangular, stacked=(), scale=1.0, damping=False):
    """The reference's loop: an update of every Q when the step counter reaches 1 / prob."""
    opts = {}
    for k, p in params.items():
        layers = p.shape[0] if k in stacked else None
        inner = p.shape[1:] if layers else p.shape
        count = layers or 1
        made = [NpKron(inner, triangular=triangular(inner), scale=scale) for _ in range(count)]
        opts[k] = made if layers else made[0]
    counter, history = 0, []
    for t, grads in enumerate(grads_seq):
        counter += 1
        update = counter >= 1 / prob
        counter = 0 if update else counter
        new = {}
        for k, p in params.items():
            per = list(zip(opts[k], grads[k], noises[t][k], strict=True)) if k in stacked else [(opts[k], grads[k], noises[t][k])]
            dirs = []
            for opt, g, v in per:
                m = opt.momentum(g)
                if update:
                    opt.fit(m if momentum_into else g, v, damping)
                dirs.append(opt.precondition(m))
            d = np.stack(dirs) if k in stacked else dirs[0]
            new[k] = p - lr * (d + (wd * p if p.ndim >= 2 else 0.0))
        params = new
        history.append(params)
    return history


SHAPES = {"w": (8, 12), "u": (12, 5), "b": (12,), "s": ()}
CASES = [
    dict(max_size_triangular=8192, memory_save_mode="none", update_probability=1.0, momentum_into_precond_update=True),
    dict(max_size_triangular=10, memory_save_mode="smart_one_diag", update_probability=0.4, momentum_into_precond_update=False),
]
IDS = ["defaults-every-step", "diagonal-dims-every-3rd-step-on-gradients"]


def case_inputs(case, shapes=SHAPES, **extra):
    params = tree(0, shapes, 0.1)
    grads_seq = [tree(10 + t, shapes) for t in range(STEPS)]
    tx = kron.psgd_kron(0.05, weight_decay=0.1, beta=0.9, **(dict(balance_every=0) | extra | case))
    return params, grads_seq, tx


def triangular_rule(case):
    return lambda shape: kron.triangular_dims(shape or (1,), case["max_size_triangular"], 2, case["memory_save_mode"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_pytorch_optimizer_kron_step_by_step(case, tmp_path):
    probe = subprocess.run([TORCH_PYTHON, "-c", "import torch, pytorch_optimizer"], capture_output=True, check=False)
    if probe.returncode:
        pytest.skip(f"{TORCH_PYTHON} has no torch / pytorch_optimizer; set SPMDLAB_TORCH_PYTHON to one that does")
    params, grads_seq, tx = case_inputs(case)
    expected, noises = run_jax(tx, params, grads_seq)
    config = dict(
        names=list(SHAPES),
        steps=STEPS,
        lr=0.05,
        weight_decay=0.1,
        momentum=0.9,
        pre_conditioner_update_probability=case["update_probability"],
        max_size_triangular=case["max_size_triangular"],
        memory_save_mode=None if case["memory_save_mode"] == "none" else case["memory_save_mode"],
        momentum_into_precondition_update=case["momentum_into_precond_update"],
    )
    arrays = {"config": json.dumps(config)}
    arrays |= {f"param/{k}": np.float32(v) for k, v in params.items()}
    for t in range(STEPS):
        arrays |= {f"grad/{t}/{k}": np.float32(v) for k, v in grads_seq[t].items()}
        arrays |= {f"noise/{t}/{k}": v for k, v in noises[t].items()}
    np.savez(tmp_path / "in.npz", **arrays)
    subprocess.run([TORCH_PYTHON, str(TORCH_SCRIPT), tmp_path / "in.npz", tmp_path / "out.npz"], check=True)
    torch_out = np.load(tmp_path / "out.npz")
    for t in range(STEPS):
        for k in SHAPES:
            np.testing.assert_allclose(expected[t][k], torch_out[f"{t}/{k}"], rtol=2e-5, atol=2e-6, err_msg=f"step {t + 1}, {k}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_numpy_transcription_step_by_step(case):
    """Also: a stacked leaf's leading axis is a batch axis (each entry its own Q and clip), a rebalance
    after every fit changes no step (the transcription never rebalances), ``Q(0) = init_scale^(1/k) I``."""
    params, grads_seq, tx = case_inputs(case, SHAPES | {"k": (3, 6, 5)}, balance_every=1, precond_init_scale=3.0)
    actual, noises = run_jax(tx, params, grads_seq)
    kw = dict(lr=0.05, wd=0.1, prob=case["update_probability"], momentum_into=case["momentum_into_precond_update"])
    expected = np_kron_run(params, grads_seq, noises, triangular=triangular_rule(case), stacked=("k",), scale=3.0, **kw)
    ref.assert_trees_close(actual, expected, rtol=2e-5)


def test_damping_matches_kron_torch_transcription():
    """kron_torch's ``G += sqrt(eps) mean|G| V`` before the fit (pytorch-optimizer has none): ~3e-4 apart."""
    case = CASES[0]
    params, grads_seq, tx = case_inputs(case, {"w": (8, 12)}, damping=True)
    actual, noises = run_jax(tx, params, grads_seq)
    kw = {"lr": 0.05, "wd": 0.1, "prob": 1.0, "momentum_into": True, "triangular": triangular_rule(case)}
    ref.assert_trees_close(actual, np_kron_run(params, grads_seq, noises, damping=True, **kw), rtol=2e-5)


def test_update_probability_schedule():
    schedule = kron.update_probability_schedule()
    np.testing.assert_allclose(schedule(jnp.array([0, 500, 1500, 10_000])), [1.0, 1.0, np.exp(-1.0), 0.03], rtol=1e-6)


def test_bad_memory_save_mode_is_named():
    with pytest.raises(ValueError, match="memory_save_mode"):
        kron.psgd_kron(1e-3, memory_save_mode="diag")


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(kron.psgd_kron(0.1)) < 0.05
