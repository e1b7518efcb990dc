"""The optax contract, for every registered optimizer as a user's own training loop drives it.

Each optimizer of `optim.registry.OPTIMIZERS` is built at its spec's defaults (wrappers around
AdamW, the learned optimizer with a run length) and must: take an eagerly initialised state into a
``jit`` step that donates parameters and state; run under ``flax.nnx.Optimizer``, alone and inside
`optim.quantize_state`; work under ``optax.inject_hyperparams``; accept extra keyword arguments in
``update``; keep its state's dtypes under float64 parameters; take a tree with no hidden matrix; let
``optax.tree.map_params`` map its state (alone and inside `optim.quantize_state`); give the same
updates under ``optax.inject_hyperparams`` as without it (issue 48 item 8: optax's own contrib
harness, ``optax/contrib/_common_test.py``, run over the registry). The transform wrappers (`cautious`,
`quantize_state`) are checked around AdamW. Tiny pytrees, a few steps each; the
update rules are checked per optimizer in its own file, training-like use in ``test_common.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from optim import registry, spec
from optim.cautious import cautious
from optim import quantize_state as qs
from optim.quantize_state import quantize_state

NAMES = sorted(registry.OPTIMIZERS)
# The wrappers that take a transform (besides the registered DiLoCo / PowerSGD), around AdamW:
# ``(function, its static arguments under inject_hyperparams, its keyword arguments here)``.
WRAPPERS = {
    "cautious": (cautious, (), {}),
    "quantize_state": (quantize_state, qs.STATIC_ARGS, {"bits": 8, "min_size": 64}),
}
EVERY = NAMES + sorted(WRAPPERS)
LAYERS, D, HEADS = 2, 8, 2
# Fields a spec must be given to be built at all (the learned optimizer's run length).
REQUIRED = {"lopt": {"num_steps": 10}}


def build(name: str, **fields) -> optax.GradientTransformationExtraArgs:
    """Optimizer ``name`` at its spec's defaults (``fields`` replacing some), or a wrapper around AdamW."""
    if name in WRAPPERS:
        fn, _, kwargs = WRAPPERS[name]
        return fn(build("adamw"), **kwargs)
    cls = registry.spec_class(name)
    fields = {**REQUIRED.get(name, {}), **fields}
    if issubclass(cls, spec.WrapperSpec):
        fields.setdefault("inner", build(cls.default_inner))
    else:
        fields.setdefault("learning_rate", spec.defaults(cls)["learning_rate"])
    return cls(**fields).transform()


def params(dtype=jnp.float32):
    """A miniature LM tree under the model's names: stacked q/k kernels and norm scale, an embedding,
    a final norm scale."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(0.1 * rng.standard_normal(shape), dtype)

    return {
        "blocks": {"attn": {"q_proj": {"kernel": r(LAYERS, D, D)}, "k_proj": {"kernel": r(LAYERS, D, D)}}},
        "attn_norm": {"scale": r(LAYERS, D)},
        "embed": {"embedding": r(16, D)},
        "final_norm": {"scale": r(D)},
    }


def grads_like(tree, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(0.01 * rng.standard_normal(p.shape), p.dtype), tree)


def extra_args(name: str) -> dict:
    """The keyword arguments the spec declares its update needs (MuonClip's attention logits)."""
    if name in WRAPPERS:
        return {}
    return {arg: jnp.ones((LAYERS, HEADS)) for arg in registry.spec_class(name).extra_args}


@pytest.mark.parametrize("name", EVERY)
def test_eager_init_feeds_a_donating_jit_step(name):
    """``jit(step, donate_argnums=(0, 1))`` on an eagerly initialised state: no buffer used twice."""
    tx = build(name)
    p = params()
    state = tx.init(p)

    @jax.jit
    def step(p, state, g):
        updates, state = tx.update(g, state, p, **extra_args(name))
        return optax.apply_updates(p, updates), state

    donating = jax.jit(step, donate_argnums=(0, 1))
    for seed in range(2):
        p, state = donating(p, state, grads_like(p, seed))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))


@pytest.mark.parametrize("name", EVERY)
def test_update_accepts_extra_keyword_arguments(name):
    """Like every optax transform, an update ignores keyword arguments it does not use."""
    tx = build(name)
    p = params()
    update = lambda g, s, p: tx.update(g, s, p, loss=jnp.float32(1.0), **extra_args(name))  # noqa: E731
    updates, _ = jax.eval_shape(update, grads_like(p), jax.eval_shape(tx.init, p), p)
    assert jax.tree.structure(updates) == jax.tree.structure(p)


@pytest.mark.parametrize("name", EVERY)
def test_state_dtypes_survive_an_update_under_float64(name):
    """A ``lax.scan`` / ``lax.cond`` loop needs the state's dtypes fixed: float64 parameters and
    gradients must not promote any state leaf."""
    with jax.enable_x64(True):
        tx = build(name)
        p = params(jnp.float64)
        state = jax.eval_shape(tx.init, p)
        _, new = jax.eval_shape(lambda g, s, p: tx.update(g, s, p, **extra_args(name)), grads_like(p), state, p)
        before = [x.dtype for x in jax.tree.leaves(state)]
        after = [x.dtype for x in jax.tree.leaves(new)]
    assert after == before


@pytest.mark.parametrize("name", EVERY)
def test_weight_decay_never_touches_stacked_norm_scales_or_biases(name):
    """issue 34 item 1: with zero gradients an update is weight decay alone; a scan-stacked norm scale
    ``(layers, d)`` and the MoE router bias ``(layers, experts)`` must not move, kernels must."""
    if name == "lopt":
        pytest.skip("no weight decay: its learned step moves every leaf")
    if name == "scion":
        pytest.skip("constrained Scion's Frank-Wolfe step (1 - lr) W + lr rho d moves every leaf, as the reference's does")
    fields = {}
    if name in registry.OPTIMIZERS and "weight_decay" in spec.defaults(registry.spec_class(name)):
        fields["weight_decay"] = 0.1
    tx = build(name, **fields)
    p = dict(params(), router={"bias": jnp.ones((LAYERS, 4))})
    zeros = jax.tree.map(jnp.zeros_like, p)
    updates, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra_args(name)))(zeros, tx.init(p), p)
    assert not np.asarray(updates["attn_norm"]["scale"]).any() and not np.asarray(updates["router"]["bias"]).any()
    if fields or name == "quantize_state":  # decay reaches the update (cautious masks it with g = 0)
        assert np.asarray(updates["embed"]["embedding"]).any()


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_shaped_gradient_is_named_at_trace_time(name):
    """issue 34 item 11: SOAP raised ``KeyError: 'b5'``, DeMo reshaped a transposed gradient silently,
    the others raised a broadcasting error naming no leaf."""
    tx = build(name)
    p = {"blocks": {"mlp": {"kernel": jnp.ones((2, 8, 12))}}}
    transposed = {"blocks": {"mlp": {"kernel": jnp.ones((2, 12, 8))}}}
    update = lambda g, s, p: tx.update(g, s, p, **extra_args(name))  # noqa: E731
    with pytest.raises(ValueError, match=r"blocks/mlp/kernel has shape \(2, 12, 8\)"):
        jax.jit(update).trace(transposed, tx.init(p), p)


def injected(name: str, **fields) -> optax.GradientTransformationExtraArgs:
    """``optax.inject_hyperparams`` over optimizer ``name``'s public function, its static arguments
    declared by the spec (``static_args``); every other numeric field is injected."""
    if name in WRAPPERS:
        fn, static_args, kwargs = WRAPPERS[name]
        return optax.inject_hyperparams(fn, static_args=static_args)(build("adamw"), **kwargs)
    cls = registry.spec_class(name)
    fn = spec.function(cls, name=name)
    kwargs = {**REQUIRED.get(name, {}), **fields}
    if issubclass(cls, spec.WrapperSpec):
        kwargs.setdefault("inner", build(cls.default_inner))
    else:
        kwargs.setdefault("learning_rate", spec.defaults(cls)["learning_rate"])
    return optax.with_extra_args_support(optax.inject_hyperparams(fn, static_args=cls.static_args)(**kwargs))


@pytest.mark.parametrize("name", EVERY)
def test_inject_hyperparams_with_the_declared_static_args(name):
    tx = injected(name)
    p = params()
    state = tx.init(p)
    updates, state = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra_args(name)))(grads_like(p), state, p)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name, arg", [("powersgd", "rank"), ("diloco", "sync_every"), ("quantize_state", "bits")])
def test_inject_hyperparams_names_the_argument_to_make_static(name, arg):
    """An argument that sets shapes or the schedule, injected anyway, gets an error naming it and
    ``static_args`` (was a raw TracerBoolConversionError / unhashable-type error)."""
    if name in WRAPPERS:
        tx = optax.inject_hyperparams(WRAPPERS[name][0], static_args=())(build("adamw"), bits=8)
    else:
        tx = optax.inject_hyperparams(spec.function(registry.spec_class(name), name=name), static_args=())(
            build("adamw"), **{arg: 2}
        )
    p = params()
    with pytest.raises(ValueError, match=f"{arg}.*static_args"):
        jax.jit(tx.update)(grads_like(p), tx.init(p), p)


class Tiny(nnx.Module):
    """A two-layer MLP with a norm scale, its kernels big enough for `quantize_state`'s default mask."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(64, 96, rngs=rngs)
        self.down = nnx.Linear(96, 64, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((64,)))

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x * self.scale)))


@pytest.mark.parametrize("name", NAMES)
def test_runs_under_nnx_optimizer_with_quantized_state(name):
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` keeps the state in nnx variables: two updates, each
    optimizer inside `quantize_state` (which crashed on the second; without it the state is plain)."""
    if name == "muon_clip":
        pytest.skip("MuonClip needs attention kernels and their logits (tests/optim/test_muon_clip.py)")
    tx = quantize_state(build(name), bits=8, min_size=1024)
    model = Tiny(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)

    @nnx.jit
    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    for _ in range(2):
        train_step(model, optimizer, x)
    assert np.isfinite(np.asarray(model.up.kernel[...])).all()



@pytest.mark.parametrize("name", EVERY)
def test_a_tree_with_no_hidden_matrix(name):
    """issue 48 item 8: Dion, Dion2 and Conda unpacked an empty leaf list (``not enough values to
    unpack``) when `optax.partition` handed their branch no parameter."""
    if name == "muon_clip":
        pytest.skip("MuonClip needs attention kernels and their logits (tests/optim/test_muon_clip.py)")
    tx = build(name)
    p = {"norm": {"scale": jnp.ones(8)}, "bias": jnp.zeros(4)}
    extra = {arg: jnp.ones((LAYERS, HEADS)) for arg in extra_args(name)}
    updates, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, **extra))(grads_like(p), tx.init(p), p)
    assert jax.tree.structure(updates) == jax.tree.structure(p)
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "quantize_state"])
@pytest.mark.parametrize("name", NAMES)
def test_optax_map_params_maps_the_state(name, quantized):
    """issue 48 item 8: ``optax.tree.map_params`` initialises on a shapeless placeholder; a state part
    whose structure follows the parameters' shapes (block stacks, Kronecker factors, quantized codes)
    comes out of it as one `optim.common.ShapesUnknown` leaf, matched whole as non-parameter state."""
    tx = build(name)
    if quantized:
        tx = quantize_state(tx, bits=8, min_size=64)
    p = params()
    state = tx.init(p)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731  # the other group's leaves (optax.partition)
    same = optax.tree.map_params(tx, lambda x: x, state, is_leaf=masked)
    assert jax.tree.structure(same) == jax.tree.structure(state)
    tagged = optax.tree.map_params(
        tx, lambda x: x if masked(x) else "param", state, transform_non_params=lambda x: "other", is_leaf=masked
    )
    leaves = jax.tree.leaves(tagged)
    assert leaves and set(leaves) <= {"param", "other"}


@pytest.mark.parametrize("name", EVERY)
def test_inject_hyperparams_gives_the_direct_updates(name, default_emitters):
    """issue 48 item 8: hyperparameters injected as float32 arrays must give the updates of the Python
    floats (rtol 1e-5, optax's harness): Scion's ``1 - momentum``, MARS-Muon's ``beta / (1 - beta)``
    and COSMOS's ``1 - b1`` rounded differently in double precision. COSMOS at rank 2 (below the
    gradients' rank), where its subspace Adam does not divide rounding error by ``eps``. Compiled as XLA
    compiles by default: the suite's fast legacy emitters round COSMOS's two programs apart (1.3e-9 on a
    1.8e-7 entry); every other optimizer meets the bound under them, and compiles in half the time."""
    fields = {"rank": 2} if name == "cosmos" else {}
    tx, inj = build(name, **fields), injected(name, **fields)
    p = params()
    options = default_emitters if name == "cosmos" else None
    step, step_inj = (jax.jit(lambda g, s, p, t=t: t.update(g, s, p, **extra_args(name)), compiler_options=options) for t in (tx, inj))
    state, state_inj = tx.init(p), inj.init(p)
    for seed in range(2):  # one program per transform, not per step
        g = grads_like(p, seed)
        updates, state = step(g, state, p)
        updates_inj, state_inj = step_inj(g, state_inj, p)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(updates_inj), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-9)


def test_quantize_state_under_inject_hyperparams_with_its_defaults():
    """issue 48 item 8: optax injects every numeric default, so ``bits=8`` as a default made
    ``inject_hyperparams(quantize_state)(inner)`` fail; its shape-setting defaults are None now."""
    inj = optax.inject_hyperparams(quantize_state)(build("adamw"), min_size=None)
    direct = quantize_state(build("adamw"))
    p, g = params(), grads_like(params())
    a, _ = jax.jit(direct.update)(g, direct.init(p), p)
    b, _ = jax.jit(inj.update)(g, inj.init(p), p)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6)
