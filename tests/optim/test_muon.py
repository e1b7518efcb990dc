"""Muon (optim/muon.py) and Newton-Schulz (optim/newton_schulz.py).

NumPy float64 references (muon_reference.py), agreement with optax.contrib.muon, Newton-Schulz
quality bands, batching, inject_hyperparams, sharding on 8 CPU devices, errors, and the tiny LM.
"""

import functools
import re

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from experiments import train_lib
from experiments.configs import default
from lm import config as model_config
from lm import model as model_lib
from optim import build
from optim import newton_schulz as ns
from optim.muon import muon, scale_by_muon
from sharding import rules as rules_lib

grads_sequence, run_jax, assert_trees_close = ref.grads_sequence, ref.run_jax, ref.assert_trees_close


# Together the cases cover every momentum form, Nesterov on/off, every preset, both shape scales, a
# user table cut to fewer steps than rows, a preset table run past its last row, and both batchings.
CASES = [
    dict(momentum_form="ema", nesterov=True, ns_coeffs="jordan", ns_steps=0, shape_scale="moonlight"),
    dict(momentum_form="sum", nesterov=False, ns_coeffs="polar_express", ns_steps=9, shape_scale="jordan"),
    dict(
        momentum_form="ema",
        nesterov=False,
        ns_coeffs="turbo",
        ns_steps=0,
        shape_scale="moonlight",
        ns_batching="same_shape",
    ),
    dict(
        momentum_form="sum",
        nesterov=True,
        ns_coeffs=((3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (1.9, -1.3, 0.4)),
        ns_steps=2,
        shape_scale="jordan",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v)[:14] for v in c.values()))
def test_matches_numpy_reference_step_by_step(case):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    expected = ref.run_matrix_family(
        params,
        grads_seq,
        ref.muon_direction(
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
    tx = muon(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, **case)
    assert_trees_close(run_jax(tx, params, grads_seq), expected)


def test_adam_group_follows_the_schedule_and_tied_embedding_is_not_orthogonalised():
    params = ref.f32(ref.model_tree(1, scale=0.1))
    grads_seq = grads_sequence(params, n=3)
    schedule = optax.linear_schedule(0.02, 0.002, 3)
    tx = muon(schedule, adam_lr_ratio=0.5, weight_decay=0.0)
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
    params = ref.f32(
        {"w": rng.standard_normal((12, 20)), "stack": rng.standard_normal((3, 16, 8)), "b": rng.standard_normal(20)}
    )
    grads_seq = grads_sequence(params)
    lr, adam_lr = 0.03, 0.01
    ours = muon(lr, nesterov=False, shape_scale=shape_scale, ns_eps=1e-8, weight_decay=0.1, adam_learning_rate=adam_lr)

    def dims(p):
        return jax.tree.map(lambda x: optax.contrib.MuonDimensionNumbers(-2, -1) if x.ndim >= 2 else None, p)

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
        x = (
            rng.standard_normal((m, n))
            if spectrum == "gaussian"
            else svd_matrix(rng, m, n, np.geomspace(1, 1e-2, min(m, n)))
        )
        for preset, steps in (("turbo", 4), ("jordan", 5)):
            out = np.asarray(
                jax.jit(ns.newton_schulz, static_argnums=(1, 2))(jnp.float32(x), preset, steps), np.float64
            )
            errors[preset].append(polar_error(x, out))
    assert max(errors["turbo"]) <= max(errors["jordan"]), errors


@pytest.mark.parametrize("preset, bound", [("jordan", 0.035), ("polar_express", 0.03), ("turbo", 0.015)])
def test_bfloat16_iteration_keeps_float32_coefficients(preset, bound):
    """bf16 matmul inputs, float32 coefficients and accumulation: within a few percent of float32.

    Rounding the coefficients to bf16 (jordan's (3.4445, -4.7750, 2.0315) becomes (3.4375, -4.78125,
    2.03125)) and the iterate after every product puts the result 3.3-6.3% (jordan), 7-10%
    (polar_express) and 2.3-3.3% (turbo) off the float32 iteration on these matrices, beyond each bound.
    """
    for seed, shape in enumerate([(2, 32, 64), (2, 64, 96), (1, 96, 160)]):
        x = jax.random.normal(jax.random.key(seed), shape)
        full = jax.jit(ns.newton_schulz, static_argnums=1)(x, preset)
        half = jax.jit(functools.partial(ns.newton_schulz, dtype="bfloat16"), static_argnums=1)(x, preset)
        assert half.dtype == x.dtype
        assert float(jnp.linalg.norm(full - half) / jnp.linalg.norm(full)) < bound, (preset, shape)
        s = np.linalg.svd(np.asarray(half), compute_uv=False)
        assert 0.6 < s.min() and s.max() < 1.25


def test_auto_dtype_is_float32_on_cpu():
    x = jax.random.normal(jax.random.key(0), (16, 24))
    np.testing.assert_array_equal(ns.newton_schulz(x, dtype="auto"), ns.newton_schulz(x, dtype="float32"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ns.newton_schulz(x, dtype="float16")


def test_batching_over_leading_axes_and_merged_axes():
    rng = np.random.default_rng(7)
    stack = rng.standard_normal((2, 3, 12, 20))
    got = jax.jit(ns.orthogonalize)({"w": jnp.float32(stack)})["w"]
    np.testing.assert_allclose(np.asarray(got), ref.orthogonalize(np.float32(stack).astype(np.float64)), atol=2e-5)

    torch_layout = jnp.float32(rng.standard_normal((20, 12)))  # (out, in)
    got = jax.jit(ns.orthogonalize, static_argnums=1)(torch_layout, ns.MatrixAxes(fan_in=-1, fan_out=-2))
    np.testing.assert_allclose(np.asarray(got), ref.newton_schulz(np.asarray(torch_layout, np.float64).T).T, atol=2e-5)

    heads = jnp.float32(rng.standard_normal((16, 4, 6)))  # (d_model, heads, head_dim)
    got = jax.jit(ns.orthogonalize, static_argnums=1)(heads, ns.MatrixAxes(fan_in=0, fan_out=(1, 2)))
    expected = ref.newton_schulz(np.asarray(heads, np.float64).reshape(16, 24)).reshape(16, 4, 6)
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5)


def count_dots(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.xla_optimized  # atol 1e-6 across two programs: the result of XLA's optimised numerics
def test_same_shape_matrices_share_one_newton_schulz_call():
    tree = jax.tree.map(jnp.float32, ref.model_tree(2))
    matrices = {
        "q": tree["blocks"]["attn"]["q_proj"]["kernel"],
        "o": tree["blocks"]["attn"]["o_proj"]["kernel"],
        "gate": tree["blocks"]["mlp"]["gate_proj"]["kernel"],
        "down": tree["blocks"]["mlp"]["down_proj"]["kernel"],
    }
    batched = functools.partial(ns.orthogonalize, batching="same_shape")
    separate = functools.partial(ns.orthogonalize, batching="none")
    per_call = 3 * 5  # three matmuls per step, five steps
    assert count_dots(batched, matrices) == 2 * per_call  # {q, o} are 8x8, {gate, down^T} are 8x12
    assert count_dots(separate, matrices) == 4 * per_call
    assert_trees_close(jax.jit(batched)(matrices), jax.jit(separate)(matrices), rtol=0, atol=1e-6)


def test_works_under_inject_hyperparams_with_traced_ns_steps():
    params = ref.f32(ref.model_tree(3, scale=0.1))
    grads_seq = grads_sequence(params, n=3)
    plain = run_jax(muon(0.02, ns_coeffs="polar_express", ns_steps=6), params, grads_seq)
    injected = optax.inject_hyperparams(muon)(learning_rate=0.02, ns_coeffs="polar_express", ns_steps=6)
    assert_trees_close(run_jax(injected, params, grads_seq), plain, rtol=1e-6)
    state = injected.init(jax.tree.map(jnp.float32, params))
    assert set(state.hyperparams) >= {"learning_rate", "beta", "ns_steps", "weight_decay"}


@pytest.mark.devices(8)
# "auto", the default: test_common.py; "as_is" is GSPMD's own partitioning of the iteration (its
# collectives: the next test).
@pytest.mark.parametrize("ns_sharding", ["replicated", "owner"])
def test_sharded_on_8_devices_matches_single_device(ns_sharding):
    params = jax.tree.map(jnp.float32, ref.model_tree(4, d=16, heads=2, head_dim=8, mlp=24, scale=0.1))
    grads = jax.tree.map(jnp.float32, ref.model_tree(5, d=16, heads=2, head_dim=8, mlp=24))
    tx = muon(0.02, ns_sharding=ns_sharding, ns_batching="same_shape")
    ref.check_sharded_matches_single_device(tx, params, grads)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "layout,ns_sharding,batch,expected",
    [
        (jax.P(None, "fsdp", None), "as_is", 8, {"all-gather": 15, "all-to-all": 0}),  # short side sharded
        (jax.P(None, None, "fsdp"), "as_is", 8, {"all-gather": 0, "all-reduce": 6}),  # long side: Gram all-reduce
        (jax.P(None, "fsdp", None), "replicated", 8, {"all-gather": 1, "all-to-all": 0}),
        (jax.P(None, "fsdp", None), "owner", 8, {"all-gather": 0, "all-to-all": 2}),
        (jax.P(None, "fsdp", None), "auto", 8, {"all-gather": 0, "all-to-all": 2}),  # one matrix per device
        (jax.P(None, "fsdp", None), "auto", 4, {"all-gather": 1, "all-to-all": 0}),  # 4 do not split 8 ways
        (jax.P(None, "fsdp", None), "auto", 12, {"all-gather": 0, "all-to-all": 2}),  # 12 >= 8: padded to 16
    ],
)
def test_ns_sharding_communicates_as_documented(layout, ns_sharding, batch, expected):
    """The collectives of orthogonalize's docstring, counted in the compiled program (batch x (64, 96))."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        sharding = jax.NamedSharding(mesh, layout)
        fn = jax.jit(functools.partial(ns.orthogonalize, sharding=ns_sharding), out_shardings=sharding)
        hlo = fn.lower(jax.ShapeDtypeStruct((batch, 64, 96), jnp.float32, sharding=sharding)).compile().as_text()
    for op, count in expected.items():
        assert len(re.findall(rf" {op}(-start)?\(", hlo)) == count, op


def test_auto_layout_gives_a_stack_the_mesh_axes_that_divide_it():
    mesh = {"fsdp": 4, "tensor": 2}
    assert [ns.dividing_axes(b, mesh) for b in (8, 4, 6, 3)] == [("fsdp", "tensor"), ("fsdp",), ("tensor",), ()]


def test_momentum_dtype_and_update_dtype():
    params = {"w": jnp.zeros((4, 6), jnp.bfloat16)}
    tx = scale_by_muon(mu_dtype="bfloat16")
    state = tx.init(params)
    assert state.mu["w"].dtype == jnp.bfloat16
    updates, state = tx.update({"w": jnp.ones((4, 6), jnp.bfloat16)}, state)
    assert updates["w"].dtype == jnp.bfloat16 and state.mu["w"].dtype == jnp.bfloat16


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown Newton-Schulz preset"):
        muon(0.01, ns_coeffs="fast")
    with pytest.raises(ValueError, match=r"shape \(n, 3\)"):
        muon(0.01, ns_coeffs=((1.0, 2.0),))
    with pytest.raises(ValueError, match="momentum_form"):
        muon(0.01, momentum_form="heavy")
    with pytest.raises(ValueError, match="label it 'adam'"):
        scale_by_muon().init({"bias": jnp.zeros(4)})
    with pytest.raises(ValueError, match="label it 'adam'"):
        muon(0.01, param_labels=lambda p: jax.tree.map(lambda _: "matrix", p)).init({"bias": jnp.zeros(4)})
    with pytest.raises(ValueError, match="steps must be >= 1"):
        ns.newton_schulz(jnp.ones((4, 4)), steps=-1)


@pytest.mark.devices(8)
def test_state_of_every_family_is_sharded_like_the_tiny_model():
    """On the real `tiny` model with the fsdp rules on 8 devices, the momentum-like state of each Muon
    family optimizer takes its parameter's sharding (abstract: no compilation)."""
    model_def = model_lib.define(model_config.from_preset("tiny"))
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    for name, fields in [
        ("muon", ("mu",)),
        ("normuon", ("mu",)),
        ("mars_muon", ("mu", "prev_grad")),
        ("muon_clip", ("mu",)),
    ]:
        tx = build.build(default.optimizer_config(name), 100)
        shardings = train_lib.make_shardings(model_def, tx, mesh, rules_lib.make_rules("fsdp"))
        kernel = shardings.params["blocks"]["mlp"]["up_proj"]["kernel"]
        assert kernel.spec != jax.P()  # the rules do shard it
        state = shardings.state["opt_state"]
        found = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                state, is_leaf=lambda x: isinstance(x, jax.NamedSharding)
            )
            if any(getattr(k, "name", None) in fields for k in path) and "up_proj" in str(path)
        ]
        assert found and all(sh == kernel for sh in found), (name, found)
