"""Dion2 (optim/dion2.py): NumPy transcription of microsoft/dion's Dion2, the selection, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import math

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import pytest

from experiments import hlo_bytes
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


def np_select(slices, fraction, blocks):
    """Indices of the top ``ceil(fraction n / blocks)`` L1 norms in each of ``blocks`` contiguous blocks."""
    size = len(slices) // blocks
    k = max(1, math.ceil(fraction * size))
    norms = np.abs(slices).sum(axis=1)
    return np.concatenate([b * size + np.argsort(-norms[b * size : (b + 1) * size])[:k] for b in range(blocks)])


def np_dion2_direction(*, fraction, ef_decay, blocks=lambda n: 1):
    """``dion2_pre_orthogonalize`` + ``polar_express`` + ``dion2_post_orthogonalize`` on X = W^T;
    ``blocks(n)``: the shards whose local slices are selected apart (the reference's FSDP path)."""
    ms = {}

    def direction(key, g, p):
        m = ms.get(key, np.zeros_like(g))
        out, new_m = np.empty_like(g), np.empty_like(g)
        for i in np.ndindex(g.shape[:-2]):
            x = m[i].T + g[i].T  # (fan_out, fan_in)
            rows = x.shape[0] <= x.shape[1]
            slices = x if rows else x.T
            idx = np_select(slices, fraction, blocks(len(slices)))
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


LOCAL_TREE = {"wide": (2, 16, 24), "tall": (24, 16), "odd": (12, 20)}  # shorter sides 16, 16, 12


@pytest.mark.devices(8)
def test_local_selection_on_8_devices_matches_numpy_per_shard():
    """On fsdp:8 a 16-slice side is 8 blocks of 2, one per device, 1 slice each (fraction 1/4);
    12 slices do not split over 8 devices: one block, as global. Three steps, momentum included."""
    rng = np.random.default_rng(1)
    grads_seq = [{k: np.float32(rng.standard_normal(s)) for k, s in LOCAL_TREE.items()} for _ in range(3)]
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    layout = {"wide": jax.P(None, "fsdp", None), "tall": jax.P(None, "fsdp"), "odd": jax.P()}
    tx = scale_by_dion2(fraction=0.25, ef_decay=0.9, selection_scope="local")
    direction = np_dion2_direction(fraction=0.25, ef_decay=0.9, blocks=lambda n: 8 if n % 8 == 0 else 1)
    with jax.set_mesh(mesh):
        shardings = {k: jax.NamedSharding(mesh, spec) for k, spec in layout.items()}
        state = jax.jit(tx.init, out_shardings=type(tx.init(grads_seq[0]))(mu=shardings))(grads_seq[0])
        update = jax.jit(tx.update, out_shardings=(shardings, None))
        for grads in grads_seq:
            actual, state = update(jax.device_put(grads, shardings), state)
            for key, g in grads.items():
                expected = direction(key, np.float64(g), None)
                np.testing.assert_allclose(actual[key], expected, rtol=1e-4, atol=1e-5, err_msg=key)
    moved = np.abs(np.asarray(actual["wide"])).sum(-1) > 0  # (2, 16): one slice in each pair of rows
    assert moved.reshape(2, 8, 2).sum(-1).tolist() == [[1] * 8] * 2


@pytest.mark.devices(8)
def test_local_selection_gathers_fewer_bytes_than_global():
    """FSDP-sharded (4, 64, 128) on 8 devices: local needs no norms nor slices from other devices for
    the selection; only the selected quarter is gathered for Newton-Schulz."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.NamedSharding(mesh, jax.P(None, "fsdp", None))
    x = jax.ShapeDtypeStruct((4, 64, 128), jnp.float32, sharding=sharding)
    found = {}
    with jax.set_mesh(mesh):
        for scope in ("global", "local"):
            tx = scale_by_dion2(selection_scope=scope)
            state = type(tx.init(x))(mu=x)
            hlo = jax.jit(tx.update, out_shardings=(sharding, None)).lower(x, state).compile().as_text()
            found[scope] = [(c.kind, c.payload * c.count) for c in hlo_bytes.collectives(hlo, 8)]
    quarter = 4 * 16 * 128 * 4  # the selected rows, gathered for Newton-Schulz
    assert found["local"] == [("all-gather", quarter)]
    assert sum(b for _, b in found["global"]) > quarter  # and the slice norms of every device


def test_selection_scope_is_checked():
    with pytest.raises(ValueError, match="selection_scope"):
        dion2(0.01, selection_scope="shard")
