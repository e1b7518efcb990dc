"""Muon (optim/muon.py) and Newton-Schulz (optim/newton_schulz.py).

NumPy float64 references (muon_reference.py), agreement with optax.contrib.muon, Newton-Schulz
quality bands, batching, inject_hyperparams, sharding on 8 CPU devices, errors, and the tiny LM.
"""

import functools

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim import labels
from optim import muon as muon_lib
from optim import newton_schulz as ns
from sharding import partition

STEPS = 6


def grads_sequence(params, n=STEPS, seed=100):
    return [ref.f32(jax.tree.map(lambda p, s=seed + t: np.random.default_rng(s).standard_normal(p.shape), params)) for t in range(n)]


def run_jax(tx, params, grads_seq, **extra):
    """Parameters after each step of ``tx`` under `jax.jit`, as float64 NumPy."""
    params = jax.tree.map(jnp.float32, params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    out = []
    for grads in grads_seq:
        params, state = step(params, state, jax.tree.map(jnp.float32, grads))
        out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), params))
    return out


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    """rtol 1e-5; the atol (1e-5 of the parameters' ~0.1 scale) only matters for entries near 0."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def np_muon_direction(*, beta, form, nesterov, coeffs, steps, scale, eps=1e-7):
    mus = {}

    def direction(key, g, p):
        d, mus[key] = ref.momentum(g, mus.get(key, 0.0), beta, form, nesterov)
        return ref.shape_scale(p.shape, scale) * ref.orthogonalize(d, coeffs, steps, eps)

    return direction


CASES = [
    dict(momentum_form="ema", nesterov=True, ns_coeffs="jordan", ns_steps=0, shape_scale="moonlight"),
    dict(momentum_form="ema", nesterov=False, ns_coeffs="jordan", ns_steps=0, shape_scale="jordan"),
    dict(momentum_form="sum", nesterov=True, ns_coeffs="jordan", ns_steps=0, shape_scale="jordan"),
    dict(momentum_form="sum", nesterov=False, ns_coeffs="jordan", ns_steps=0, shape_scale="moonlight"),
    dict(momentum_form="ema", nesterov=True, ns_coeffs="polar_express", ns_steps=0, shape_scale="moonlight"),
    dict(momentum_form="ema", nesterov=True, ns_coeffs="polar_express", ns_steps=9, shape_scale="moonlight"),
    dict(momentum_form="ema", nesterov=True, ns_coeffs="turbo", ns_steps=0, shape_scale="moonlight"),
    dict(momentum_form="ema", nesterov=True, ns_coeffs=((3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (1.875, -1.25, 0.375)), ns_steps=2, shape_scale="jordan"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v)[:14] for v in c.values()))
def test_matches_numpy_reference_step_by_step(case):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    expected = ref.run_matrix_family(
        params,
        grads_seq,
        np_muon_direction(
            beta=0.9,
            form=case["momentum_form"],
            nesterov=case["nesterov"],
            coeffs=case["ns_coeffs"],
            steps=case["ns_steps"],
            scale=case["shape_scale"],
        ),
        lr=lr,
        adam_lr=adam_lr,
        wd=wd,
    )
    tx = muon_lib.muon(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, **case)
    assert_trees_close(run_jax(tx, params, grads_seq), expected)


def test_adam_group_follows_the_schedule_and_tied_embedding_is_not_orthogonalised():
    params = ref.f32(ref.model_tree(1, scale=0.1))
    grads_seq = grads_sequence(params, n=3)
    schedule = optax.linear_schedule(0.02, 0.002, 3)
    tx = muon_lib.muon(schedule, adam_lr_ratio=0.5, weight_decay=0.0)
    got = run_jax(tx, params, grads_seq)
    adam = ref.AdamW()
    emb = params["embed"]["embedding"]
    for t, grads in enumerate(grads_seq):
        emb = emb + adam.update(0, grads["embed"]["embedding"], emb, 0.5 * float(schedule(t)), 0.0)
        np.testing.assert_allclose(got[t]["embed"]["embedding"], emb, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape_scale,consistent_rms", [("jordan", None), ("moonlight", 0.2)])
def test_agrees_with_optax_contrib_muon(shape_scale, consistent_rms):
    """optax.contrib.muon(nesterov=False) == muon(momentum_form="ema", nesterov=False), same eps.

    optax bias-corrects its EMA; without Nesterov that is a scalar per step, removed by Newton-Schulz's
    normalisation (up to eps, so eps is set equal). Its Adam group uses optax's adamw with
    adam_weight_decay on every Adam leaf; here those leaves are 1-D, which our AdamW never decays.
    """
    rng = np.random.default_rng(0)
    params = ref.f32({"w": rng.standard_normal((12, 20)), "stack": rng.standard_normal((3, 16, 8)), "b": rng.standard_normal(20)})
    grads_seq = grads_sequence(params)
    lr, adam_lr = 0.03, 0.01
    ours = muon_lib.muon(
        lr, nesterov=False, shape_scale=shape_scale, ns_eps=1e-8, weight_decay=0.1, adam_learning_rate=adam_lr
    )
    dims = lambda p: jax.tree.map(lambda x: optax.contrib.MuonDimensionNumbers(-2, -1) if x.ndim >= 2 else None, p)  # noqa: E731
    theirs = optax.contrib.muon(
        lr,
        eps=1e-8,
        nesterov=False,
        weight_decay=0.1,
        adam_b2=0.95,
        adam_learning_rate=adam_lr,
        muon_weight_dimension_numbers=dims,
        consistent_rms=consistent_rms,
    )
    assert_trees_close(run_jax(ours, params, grads_seq), run_jax(theirs, params, grads_seq))


# Newton-Schulz quality: output singular values for inputs whose normalised singular values lie in
# [floor, 1] (the table in optim/newton_schulz.py's docstring).
BANDS = {
    ("jordan", 1e-2): (0.681, 1.135),
    ("jordan", 1e-3): (0.470, 1.203),
    ("polar_express", 1e-3): (0.840, 1.124),
    ("turbo", 1e-2): (0.972, 1.146),
}


def svd_matrix(rng, m, n, singular_values):
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = np.zeros((m, n))
    np.fill_diagonal(s, singular_values)
    return u @ s @ v.T


def test_matches_scalar_polynomial_bands():
    """The docstring's bands are the scalar iteration's range on [floor, 1] (dense grid, float64)."""
    for (preset, floor), (lo, hi) in BANDS.items():
        table, steps, _, safety = ref.PRESETS[preset]
        s = np.geomspace(floor, 1.0, 20001) / safety
        for i in range(steps):
            a, b, c = table[min(i, len(table) - 1)]
            s = a * s + b * s**3 + c * s**5
        assert lo - 1e-3 < s.min() < lo + 1e-3 and hi - 1e-3 < s.max() < hi + 1e-3, (preset, floor, s.min(), s.max())


@pytest.mark.parametrize("preset,floor", list(BANDS))
@pytest.mark.parametrize("kind", ["random", "ill_conditioned"])
def test_newton_schulz_singular_values_in_band(preset, floor, kind):
    rng = np.random.default_rng(3)
    m, n = 48, 80
    if kind == "random":
        x = rng.standard_normal((m, n))
    else:  # condition number 1e3
        x = svd_matrix(rng, m, n, np.geomspace(1.0, 1e-3, m))
    out = np.asarray(jax.jit(functools.partial(ns.newton_schulz, coeffs=preset))(jnp.float32(x)), np.float64)
    # The iteration maps the singular values of its starting point (after Frobenius / AOL scaling)
    # through the scalar polynomials and keeps the singular vectors: U^T out V is diag(p(s)).
    start = ref.normalize(x, preset)
    u, s_in, vt = np.linalg.svd(start, full_matrices=False)
    s_out = np.diag(u.T @ out @ vt.T)
    in_range = s_in * ref.PRESETS[preset][3] >= floor
    lo, hi = BANDS[(preset, floor)]
    assert in_range.sum() >= m // 2
    assert np.all((s_out[in_range] > lo - 2e-3) & (s_out[in_range] < hi + 2e-3)), (s_out[in_range].min(), s_out.max())


def polar_error(x, out):
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    return np.linalg.norm(out - u @ vt) / np.sqrt(min(x.shape))


@pytest.mark.parametrize("spectrum", ["gaussian", "cond_1e2"])
def test_turbo_at_4_steps_matches_jordan_at_5(spectrum):
    rng = np.random.default_rng(5)
    errors = {"turbo": [], "jordan": []}
    for trial in range(3):
        m, n = (64, 96) if trial % 2 else (96, 64)
        x = rng.standard_normal((m, n)) if spectrum == "gaussian" else svd_matrix(rng, m, n, np.geomspace(1, 1e-2, min(m, n)))
        for preset, steps in (("turbo", 4), ("jordan", 5)):
            out = np.asarray(ns.newton_schulz(jnp.float32(x), preset, steps), np.float64)
            errors[preset].append(polar_error(x, out))
    assert max(errors["turbo"]) <= max(errors["jordan"]), errors


def test_newton_schulz_matches_numpy_and_transposes_tall_matrices():
    rng = np.random.default_rng(6)
    for shape in [(24, 40), (40, 24), (32, 32)]:
        x = rng.standard_normal(shape)
        for preset in ref.PRESETS:
            got = np.asarray(ns.newton_schulz(jnp.float32(x), preset), np.float64)
            np.testing.assert_allclose(got, ref.newton_schulz(np.float32(x).astype(np.float64), preset), atol=2e-5)


def test_bfloat16_iteration_is_close_to_float32():
    x = jax.random.normal(jax.random.key(0), (4, 32, 64))
    full = ns.newton_schulz(x, "jordan")
    half = ns.newton_schulz(x, "jordan", dtype="bfloat16")
    assert half.dtype == x.dtype
    assert float(jnp.linalg.norm(full - half) / jnp.linalg.norm(full)) < 0.05


def test_batching_over_leading_axes_and_merged_axes():
    rng = np.random.default_rng(7)
    stack = rng.standard_normal((2, 3, 12, 20))
    got = ns.orthogonalize({"w": jnp.float32(stack)})["w"]
    np.testing.assert_allclose(np.asarray(got), ref.orthogonalize(np.float32(stack).astype(np.float64)), atol=2e-5)

    torch_layout = jnp.float32(rng.standard_normal((20, 12)))  # (out, in)
    got = ns.orthogonalize(torch_layout, ns.MatrixAxes(fan_in=-1, fan_out=-2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ns.newton_schulz(torch_layout.T).T), atol=1e-6)

    heads = jnp.float32(rng.standard_normal((16, 4, 6)))  # (d_model, heads, head_dim)
    got = ns.orthogonalize(heads, ns.MatrixAxes(fan_in=0, fan_out=(1, 2)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ns.newton_schulz(heads.reshape(16, 24))).reshape(16, 4, 6), atol=1e-6)


def count_dots(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_same_shape_matrices_share_one_newton_schulz_call():
    tree = jax.tree.map(jnp.float32, ref.model_tree(2))
    matrices = {"q": tree["blocks"]["attn"]["q_proj"]["kernel"], "o": tree["blocks"]["attn"]["o_proj"]["kernel"],
                "gate": tree["blocks"]["mlp"]["gate_proj"]["kernel"], "down": tree["blocks"]["mlp"]["down_proj"]["kernel"]}
    batched = functools.partial(ns.orthogonalize, batch_same_shape=True)
    separate = functools.partial(ns.orthogonalize, batch_same_shape=False)
    per_call = 3 * 5  # three matmuls per step, five steps
    assert count_dots(batched, matrices) == 2 * per_call  # {q, o} are 8x8, {gate, down^T} are 8x12
    assert count_dots(separate, matrices) == 4 * per_call
    assert_trees_close(batched(matrices), separate(matrices), rtol=0, atol=1e-6)


def test_works_under_inject_hyperparams_with_traced_ns_steps():
    params = ref.f32(ref.model_tree(3, scale=0.1))
    grads_seq = grads_sequence(params, n=3)
    plain = run_jax(muon_lib.muon(0.02, ns_coeffs="polar_express", ns_steps=6), params, grads_seq)
    injected = optax.inject_hyperparams(muon_lib.muon)(learning_rate=0.02, ns_coeffs="polar_express", ns_steps=6)
    assert_trees_close(run_jax(injected, params, grads_seq), plain, rtol=1e-6)
    state = injected.init(jax.tree.map(jnp.float32, params))
    assert set(state.hyperparams) >= {"learning_rate", "beta", "ns_steps", "weight_decay"}


def fsdp_shardings(params, mesh):
    def spec(path, p):
        names = labels.path_names(path)
        if p.ndim == 3:  # (layers, fan_in, fan_out): shard fan_in (embed) like FSDP; o/down: fan_out
            return jax.P(None, None, "fsdp") if names[-2] in ("o_proj", "down_proj") else jax.P(None, "fsdp", None)
        return jax.P()

    return jax.tree_util.tree_map_with_path(lambda path, p: jax.NamedSharding(mesh, spec(path, p)), params)


@pytest.mark.parametrize("ns_sharding", ["as_is", "replicated", "owner"])
def test_sharded_on_8_devices_matches_single_device(ns_sharding):
    params = jax.tree.map(jnp.float32, ref.model_tree(4, d=16, heads=2, head_dim=8, mlp=24, scale=0.1))
    grads = jax.tree.map(jnp.float32, ref.model_tree(5, d=16, heads=2, head_dim=8, mlp=24))
    tx = muon_lib.muon(0.02, ns_sharding=ns_sharding)

    def two_steps(params, state, grads):
        for _ in range(2):
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    expected_params, _ = jax.jit(two_steps)(params, tx.init(params), grads)

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        p_shard = fsdp_shardings(params, mesh)
        s_shard = partition.state_shardings(jax.eval_shape(tx.init, params), params, p_shard, mesh)
        params_s = jax.device_put(params, p_shard)
        state = jax.jit(tx.init, out_shardings=s_shard)(params_s)
        step = jax.jit(two_steps, in_shardings=(p_shard, s_shard, p_shard), out_shardings=(p_shard, s_shard))
        new_params, new_state = step(params_s, state, jax.device_put(grads, p_shard))
        # State leaves mirroring a matrix get that matrix's sharding from the generic rule.
        mu_shardings = s_shard.inner_states["matrix"].inner_state[0].mu
        is_matrix = [label == labels.MATRIX for label in jax.tree.leaves(labels.matrix_labels(params))]
        matrix_shardings = [sh for sh, m in zip(jax.tree.leaves(p_shard), is_matrix, strict=True) if m]
        assert jax.tree.leaves(mu_shardings) == matrix_shardings
        assert jax.tree.leaves(new_state.inner_states["matrix"].inner_state[0].mu)[0].sharding == matrix_shardings[0]
        assert_trees_close(new_params, expected_params, rtol=1e-5, atol=1e-6)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown Newton-Schulz preset"):
        muon_lib.muon(0.01, ns_coeffs="fast")
    with pytest.raises(ValueError, match=r"shape \(n, 3\)"):
        muon_lib.muon(0.01, ns_coeffs=((1.0, 2.0),))
    with pytest.raises(ValueError, match="momentum_form"):
        muon_lib.muon(0.01, momentum_form="heavy")
    with pytest.raises(ValueError, match="label it 'adam'"):
        muon_lib.scale_by_muon().init({"bias": jnp.zeros(4)})
    with pytest.raises(ValueError, match="label it 'adam'"):
        muon_lib.muon(0.01, param_labels=lambda p: jax.tree.map(lambda _: "matrix", p)).init({"bias": jnp.zeros(4)})
    with pytest.raises(ValueError, match="steps must be >= 1"):
        ns.newton_schulz(jnp.ones((4, 4)), steps=-1)
