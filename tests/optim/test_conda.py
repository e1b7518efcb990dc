"""Conda (optim/conda.py): NumPy transcription of pytorch-optimizer's Conda, the rotated basis, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim.conda import conda, scale_by_conda


def np_conda_direction(*, b1, b2, eps, gap):
    """pytorch-optimizer ``Conda.step`` (GaLoreProjector rank=None, "std") on the transposed (out, in) matrix."""
    state = {}

    def direction(key, g, p):
        s = state.setdefault(key, {"t": 0, "m": np.zeros_like(g), "v": np.zeros_like(g), "q": [None] * len(g)})
        s["t"] += 1
        t = s["t"]
        s["m"] = b1 * s["m"] + (1 - b1) * g
        out = np.empty_like(g)
        for i in range(len(g)):  # (layers, fan_in, fan_out): one PyTorch (out, in) = (fan_out, fan_in) matrix each
            gt, mt = g[i].T, s["m"][i].T
            right = gt.shape[0] >= gt.shape[1]
            if s["q"][i] is None or t % gap == 0:
                u, _, vh = np.linalg.svd(mt, full_matrices=False)
                s["q"][i] = vh if right else u
            q = s["q"][i]
            g_low = gt @ q.T if right else q.T @ gt
            m_low = mt @ q.T if right else q.T @ mt
            s["v"][i] = b2 * s["v"][i] + (1 - b2) * (g_low * g_low).T
            n = m_low / (np.sqrt(s["v"][i].T) + eps)
            back = n @ q if right else q @ n
            out[i] = (np.sqrt(1 - b2**t) / (1 - b1**t) * back).T
        return out

    return direction


@pytest.mark.parametrize("gap", [1, 3])
def test_matches_numpy_reference_step_by_step(gap):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.01, 0.005, 0.1
    direction = np_conda_direction(b1=0.9, b2=0.99, eps=1e-8, gap=gap)
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = conda(lr, b2=0.99, update_proj_gap=gap, weight_decay=wd, adam_lr_ratio=adam_lr / lr)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_basis_is_the_shorter_side_and_refreshes_on_schedule():
    rng = np.random.default_rng(4)
    tx = scale_by_conda(update_proj_gap=2)
    params = {"tall": jnp.zeros((24, 8)), "wide": jnp.zeros((2, 8, 24))}
    state = tx.init(params)
    assert state.basis["tall"].shape == (8, 8) and state.basis["wide"].shape == (2, 8, 8)
    bases = []
    for _ in range(3):
        g = jax.tree.map(lambda p: jnp.float32(rng.standard_normal(p.shape)), params)
        _, state = jax.jit(tx.update)(g, state)
        q = np.asarray(state.basis["wide"], np.float64)
        np.testing.assert_allclose(q[0] @ q[0].T, np.eye(8), atol=1e-5)
        bases.append(q)
    assert np.abs(bases[1] - bases[0]).max() > 1e-3  # refreshed at step 2
    np.testing.assert_array_equal(bases[2], bases[1])  # kept at step 3


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(conda(0.05, update_proj_gap=10)) < 0.05


TORCH_SCRIPT = """
import sys
try:
    import numpy as np, torch, pytorch_optimizer
except ImportError:
    sys.exit(3)
data = np.load(sys.argv[1])
out = {}
for name in ("wide", "tall"):
    p = torch.nn.Parameter(torch.tensor(data[name + "_w0"].T.copy(), dtype=torch.float64))
    opt = pytorch_optimizer.Conda([p], lr=0.01, betas=(0.9, 0.99), update_proj_gap=3, weight_decay=0.0)
    steps = []
    for g in data[name + "_grads"]:
        p.grad = torch.tensor(g.T.copy(), dtype=torch.float64)
        opt.step()
        steps.append(p.detach().numpy().T.copy())
    out[name] = np.stack(steps)
np.savez(sys.argv[2], **out)
"""


def test_matches_pytorch_optimizer_conda_when_installed(tmp_path):
    """Against the installed implementation (float64 PyTorch), run in the interpreter named by
    ``SPMDLAB_TORCH_PYTHON`` (default: this interpreter); skipped where there is none."""
    python = os.environ.get("SPMDLAB_TORCH_PYTHON", sys.executable)
    missing = f"no interpreter with torch and pytorch_optimizer at {python} (set SPMDLAB_TORCH_PYTHON)"
    if not os.path.exists(python):
        pytest.skip(missing)
    rng = np.random.default_rng(8)
    data = {}
    for name, shape in (("wide", (16, 24)), ("tall", (24, 16))):  # W layout (fan_in, fan_out): both sides rotated
        data[name + "_w0"], data[name + "_grads"] = 0.1 * rng.standard_normal(shape), rng.standard_normal((6, *shape))
    np.savez(tmp_path / "in.npz", **data)
    (tmp_path / "run.py").write_text(TORCH_SCRIPT)
    run = subprocess.run([python, tmp_path / "run.py", tmp_path / "in.npz", tmp_path / "out.npz"], check=False, capture_output=True, timeout=300)
    if run.returncode == 3:
        pytest.skip(missing)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    expected = np.load(tmp_path / "out.npz")
    for name in ("wide", "tall"):
        tx = optax.chain(scale_by_conda(b2=0.99, update_proj_gap=3), optax.scale(-0.01))
        w = jnp.float32(data[name + "_w0"])
        state, update = tx.init(w), jax.jit(tx.update)
        for t, g in enumerate(data[name + "_grads"]):
            u, state = update(jnp.float32(g), state)
            w = w + u
            moved = np.abs(expected[name][t] - data[name + "_w0"]).max()
            np.testing.assert_allclose(np.asarray(w), expected[name][t], rtol=0, atol=1e-4 * moved)
