"""The MLP learned optimizer: NumPy reference of its rule, features, optax interface, sharding, weights.

Jit, inject_hyperparams, bf16, state_bits=8 + cautious, checkpoints through the registry: test_common.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lm import config as config_lib
from lm.transformer import Transformer
from optim.learned import features as feat
from optim.learned import mlp_lopt

DECAYS = mlp_lopt.INITIAL_DECAYS


@pytest.fixture(scope="module")
def meta():
    m = mlp_lopt.init_meta_params(jax.random.key(0))
    # non-zero decay offsets and biases, so the reference checks how they enter
    m["momentum_decays"] = jnp.asarray([0.01, -0.02, 0.03])
    m["adafactor_decays"] = jnp.asarray([-0.01, 0.02, 0.0])
    m["mlp"]["b0"] = 0.1 * jnp.ones_like(m["mlp"]["b0"])
    return m


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(2, 6, 8)).astype(np.float32),  # stacked layers of wide matrices
        "tall": rng.normal(size=(7, 5)).astype(np.float32),  # rows > cols: the factors swap sides
        "b": rng.normal(size=(8,)).astype(np.float32),
        "scale": rng.normal(size=(2, 8)).astype(np.float32),  # stacked norm scales: vectors by role
    }


VECTOR_LEAVES = ("b", "scale")


def _grads(seed, params):
    rng = np.random.default_rng(100 + seed)
    return {k: (0.1 * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}


def _units(params):
    """Each leaf's tensors, as the reference sees an unscanned model: ``(leaf, index)`` per layer slice."""
    return [(k, idx) for k, v in params.items() for idx in np.ndindex(*v.shape[: -1 if k in VECTOR_LEAVES else -2])]


def _reference(meta, params, grads_seq, num_steps, base_fan_in=0):
    """arXiv:2203.11860's AdafacMLPLOpt (learned_optimization's ``adafac_mlp_lopt.py``) as stated in
    optim/learned, in float64 NumPy, on every tensor separately: the layers of a stacked leaf are
    separate tensors, and a matrix's factors average over its two axes, the row factor over the
    longer one (the reference's ``factored_dims``: its two largest axes)."""
    m = jax.tree.map(lambda x: np.asarray(x, np.float64), meta)
    decay = {n: 1 - (1 - np.asarray(d)) * np.exp(10 * m[f"{n}_decays"]) for n, d in DECAYS._asdict().items()}
    w = {k: v.astype(np.float64) for k, v in params.items()}
    units = _units(params)
    mom = {u: [0.0] * 3 for u in units}
    nu = dict.fromkeys(units, 0.0)
    fac = {u: [[0.0, 0.0] for _ in range(3)] for u in units}
    for t, grads in enumerate(grads_seq):
        time = np.tanh(t / num_steps / np.asarray(feat.TIME_SCALES) - 1)
        new = {k: v.copy() for k, v in w.items()}
        for u in units:
            k, idx = u
            g, p = grads[k][idx].astype(np.float64), w[k][idx]
            for i in range(3):
                mom[u][i] = decay["momentum"][i] * mom[u][i] + (1 - decay["momentum"][i]) * g
            nu[u] = decay["rms"][0] * nu[u] + (1 - decay["rms"][0]) * g**2
            f = [g, p, *mom[u], nu[u], *(mi / np.sqrt(nu[u] + 1e-6) for mi in mom[u]), 1 / np.sqrt(nu[u] + 1e-6)]
            for j in range(3):
                a = decay["adafactor"][j]
                if g.ndim == 2:
                    d1, d0 = np.argsort(g.shape, kind="stable")  # second largest, largest
                    r = a * fac[u][j][0] + (1 - a) * np.mean(g**2 + 1e-30, axis=d0, keepdims=True)
                    c = a * fac[u][j][1] + (1 - a) * np.mean(g**2 + 1e-30, axis=d1, keepdims=True)
                    fac[u][j] = [r, c]
                    v = r * c / np.mean(r)
                    r, c = np.broadcast_to(r, g.shape), np.broadcast_to(c, g.shape)
                else:
                    r = c = v = a * fac[u][j][0] + (1 - a) * (g**2 + 1e-30)
                    fac[u][j][0] = v
                f += [g / np.sqrt(v + 1e-30), r, c, 1 / np.sqrt(r + 1e-8), 1 / np.sqrt(c + 1e-8), mom[u][j] / np.sqrt(v + 1e-30)]
            x = np.stack([fi / np.sqrt(np.mean(fi**2) + 1e-5) for fi in f], axis=-1)
            x = np.concatenate([x, np.broadcast_to(time, (*g.shape, len(time)))], axis=-1)
            for i in range(3):
                x = x @ m["mlp"][f"w{i}"] + m["mlp"][f"b{i}"]
                x = np.maximum(x, 0) if i < 2 else x
            scale = base_fan_in / p.shape[-2] if base_fan_in and k not in VECTOR_LEAVES else 1.0
            new[k][idx] = p - x[..., 0] * np.exp(1e-3 * x[..., 1]) * 1e-3 * scale
        w = new
    return w


@pytest.mark.parametrize("base_fan_in", [0, 3])
def test_matches_the_numpy_reference(meta, base_fan_in):
    params = _params()
    grads_seq = [_grads(t, params) for t in range(3)]
    tx = mlp_lopt.scale_by_mlp_lopt(meta, 10, mup_base_fan_in=base_fan_in)
    state, p = tx.init(params), params
    step = jax.jit(tx.update)
    for grads in grads_seq:
        updates, state = step(grads, state, p, loss=jnp.float32(1.0))
        p = optax.apply_updates(p, updates)
    want = _reference(meta, params, grads_seq, 10, base_fan_in)
    for k in want:
        np.testing.assert_allclose(p[k], want[k], rtol=0, atol=2e-6 * np.max(np.abs(want[k])))
    assert int(state.count) == 3


def test_a_scanned_stack_steps_like_its_layers_as_separate_leaves(meta):
    """issue 34 item 4: features normalised per layer slice, so scanned = unscanned (1-11% apart before)."""
    params, grads = _params(), _grads(0, _params())
    unstack = lambda t: {**{f"w{i}": t["w"][i] for i in range(2)}, **{f"s{i}": {"scale": t["scale"][i]} for i in range(2)}}  # noqa: E731
    tx = mlp_lopt.scale_by_mlp_lopt(meta, 10)
    stacked, _ = tx.update(grads, tx.init(params), params)
    split, _ = tx.update(unstack(grads), tx.init(unstack(params)), unstack(params))
    for i in range(2):
        np.testing.assert_allclose(stacked["w"][i], split[f"w{i}"], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(stacked["scale"][i], split[f"s{i}"]["scale"], rtol=1e-6, atol=1e-9)


def test_weights_meta_trained_as_mulo_take_its_scaling_through_lopt(meta, tmp_path):
    """``--config.optimizer.lopt.weights=<μLO weights>``: the base width comes from the weights' record."""
    path = tmp_path / "mu.npz"
    mlp_lopt.save_meta_params(path, meta, {"mup_base_fan_in": 3})
    params = _params()
    grads = _grads(0, params)
    for tx, base in ((mlp_lopt.lopt(1.0, num_steps=10, weights=str(path)), 3), (mlp_lopt.lopt(1.0, num_steps=10, meta_params=meta), 0)):
        updates, _ = tx.update(grads, tx.init(params), params)
        want = _reference(meta, params, [grads], 10, base)
        for k in want:
            np.testing.assert_allclose(params[k] + updates[k], want[k], rtol=0, atol=2e-6 * np.max(np.abs(want[k])))


def _lm_param_shapes(tie_embeddings: bool) -> dict:
    cfg = config_lib.from_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, mlp_dim=192,
                                 tie_embeddings=tie_embeddings)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model))


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_mulo_scales_the_readout_like_a_hidden_matrix(tie_embeddings):
    """μP for Adam-like steps at base width 16, on a width-64 LM: hidden matrices and the readout n0 / fan_in,
    the tied embedding (the readout too) n0 / width, an untied input embedding and the norms 1."""
    shapes = _lm_param_shapes(tie_embeddings)
    scales = mlp_lopt.mup_scales(shapes, 16)
    assert scales["blocks"]["attn"]["q_proj"]["kernel"] == 16 / 64
    assert scales["blocks"]["mlp"]["down_proj"]["kernel"] == 16 / 192
    assert scales["blocks"]["attn_norm"]["scale"] == scales["final_norm"]["scale"] == 1.0
    if tie_embeddings:
        assert "lm_head" not in shapes and scales["embed"]["embedding"] == 16 / 64
    else:
        assert scales["lm_head"]["kernel"] == 16 / 64 and scales["embed"]["embedding"] == 1.0


def test_feature_count_and_per_tensor_normalisation():
    rng = np.random.default_rng(0)
    p, g1, g2 = (jnp.asarray(100 * rng.normal(size=(5, 7)), jnp.float32) for _ in range(3))  # all raw features >> 1e-5

    @jax.jit
    def run(p, g1, g2):
        rates = mlp_lopt.decays(mlp_lopt.init_meta_params(jax.random.key(1)))
        acc = feat.init_accumulators(p, 3, 3, 2)
        acc = feat.update_accumulators(feat.update_accumulators(acc, g1, rates, 2), g2, rates, 2)
        return feat.features(p, g2, acc, feat.time_features(jnp.int32(3), 12), 2), acc

    x, acc = run(p, g1, g2)
    assert x.shape == (5, 7, feat.num_features()) == (5, 7, 33)
    n_norm = feat.num_features() - len(feat.TIME_SCALES)
    second_moments = np.mean(np.square(np.asarray(x[..., :n_norm])), axis=(0, 1))
    assert np.all(second_moments <= 1.0 + 1e-6) and np.all(second_moments > 0.97)  # m / (m + 1e-5), m >~ 1e-3 here
    y = rng.normal(size=(4, 3, 5)) * np.asarray([1e-4, 1e-3, 1e-2, 1.0, 1e3])  # one scale per feature
    m = np.mean(y**2, axis=(0, 1))
    np.testing.assert_allclose(np.mean(np.square(feat.normalize(jnp.asarray(y, jnp.float32), 2)), axis=(0, 1)), m / (m + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(x[2, 3, n_norm:], np.tanh(3 / 12 / np.asarray(feat.TIME_SCALES) - 1), rtol=1e-6)
    # the Adafactor factors keep the tensor's rank: (rows, 1) and (1, cols)
    assert acc.row[0].shape == (5, 1) and acc.col[0].shape == (1, 7)


def test_clear_errors(meta):
    """(Shapes, bf16 dtypes, jit and inject_hyperparams through the registry: test_common.py.)"""
    params = {"w": jnp.ones((3, 4), jnp.bfloat16)}
    tx = mlp_lopt.lopt(1.0, num_steps=5, meta_params=meta)
    with pytest.raises(ValueError, match="reads the parameters"):
        tx.update(params, tx.init(params))
    bad = {**meta, "mlp": {**meta["mlp"], "w0": meta["mlp"]["w0"][:-1]}}
    with pytest.raises(ValueError, match="features"):
        mlp_lopt.scale_by_mlp_lopt(bad, 5)
    with pytest.raises(ValueError, match="num_steps"):
        mlp_lopt.lopt(1.0, meta_params=meta)
    with pytest.raises(ValueError, match="mup_base_fan_in"):
        mlp_lopt.mulo(1.0, num_steps=5, weights=str(mlp_lopt.weights_path("lopt")))


@pytest.mark.devices(8)
def test_sharding_preserved_on_8_devices(meta):
    """FSDP x tensor: updates and parameter-shaped state keep the parameters' shardings; steps match the reference."""
    params = {"w": _params()["w"].reshape(4, 24)[:, :16], "b": _params()["b"]}
    grads = _grads(0, params)
    tx = mlp_lopt.scale_by_mlp_lopt(meta, 10)
    want = _reference(meta, params, [grads], 10)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shard = {"w": jax.NamedSharding(mesh, jax.P("fsdp", "tensor")), "b": jax.NamedSharding(mesh, jax.P("tensor"))}
    with jax.set_mesh(mesh):
        p = jax.device_put(params, shard)
        state = jax.jit(tx.init)(p)
        updates, state = jax.jit(tx.update)(jax.device_put(grads, shard), state, p)
    for k in params:
        assert updates[k].sharding.is_equivalent_to(shard[k], updates[k].ndim)
        for tree in (*state.mu, state.nu):
            assert tree[k].sharding.is_equivalent_to(shard[k], updates[k].ndim)
        np.testing.assert_allclose(params[k] + updates[k], want[k], rtol=0, atol=2e-6 * np.max(np.abs(want[k])))
    assert state.row[0]["w"].sharding.spec[0] == "fsdp" and state.col[0]["w"].sharding.spec[1] == "tensor"


def test_weights_round_trip(meta, tmp_path):
    path = tmp_path / "w.npz"
    mlp_lopt.save_meta_params(path, meta, {"estimator": "pes"})
    loaded = mlp_lopt.load_meta_params(path)
    assert jax.tree.structure(loaded) == jax.tree.structure(meta)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(meta), strict=True):
        np.testing.assert_array_equal(a, b)
    assert mlp_lopt.load_record(path) == {"estimator": "pes"}
    with pytest.raises(FileNotFoundError, match="meta-train"):
        mlp_lopt.load_meta_params(tmp_path / "missing.npz")


@pytest.mark.parametrize("name", ["lopt", "mulo"])
def test_shipped_weights_load_with_their_record(name):
    meta = mlp_lopt.load_meta_params(mlp_lopt.weights_path(name))
    assert meta["mlp"]["w0"].shape == (feat.num_features(), 32)
    record = mlp_lopt.load_record(mlp_lopt.weights_path(name))
    assert {"estimator", "tasks", "iterations", "command", "date", "machine"} <= set(record)
    base = 16 if name == "mulo" else 0  # μLO's base width, meta-trained at d_model 16
    assert record.get("mup_base_fan_in", 0) == base == mlp_lopt.LOpt(weights=name).mup_base_fan_in()
