"""Properties every registered optimizer must have, checked over `optim.registry.OPTIMIZERS`.

In the style of optax's ``contrib/_common_test.py``: each optimizer is built as training builds it
(`registry.build` on the default config) on a miniature of the LM's parameter tree, and must run
under `jax.jit` without retracing, work under `optax.inject_hyperparams` with a live learning rate,
give the same steps on 8 devices (FSDP-sharded parameters and state) as on one, keep bf16 parameters
in bf16, compose with ``state_bits=8`` and ``cautious``, round-trip its state through an orbax
checkpoint, and keep its state finite under zero, tiny and huge gradients. Compilation is the cost,
so each optimizer compiles three step programs: the plain one on one device (jit, checkpoint,
gradient fuzz), the injected one on 8 devices, and 8-bit + cautious on bf16 parameters; each of the
last two checks two properties against the first. The published update rules are checked per
optimizer in its own file.

Non-finite gradients are not the optimizer's to handle: the train step skips such a step and keeps
the old state (tests/experiments/test_train.py::test_non_finite_steps_are_skipped_and_counted);
`test_train_step_skips_a_step_whose_optimizer_state_overflows` covers finite gradients that overflow
an optimizer's state.
"""

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from experiments import train_lib
from experiments.configs import default
from lm.config import ModelConfig
from optim import blocking, build, registry, spec
from optim import quantization as qz
from optim.quantize_state import QuantizedState
from sharding import partition

# Optimizers built for replicas (DeMo, DiLoCo, PowerSGD) are checked where replicas exist: their
# rules on W replicas in a `jax.shard_map` (tests/optim/test_{demo,diloco,powersgd}.py, with
# tests/optim/replica_harness.py), training, resuming and refusing another replica count through the
# registry on data:8 (tests/experiments/test_replica_local.py). The wrappers have no learning rate of
# their own to inject (it is their inner optimizer's, which is checked here).
NAMES = sorted({n for n, c in registry.OPTIMIZERS.items() if not c.replica_local})
# No state leaf of a hidden matrix's shape, so nothing here for state_bits to quantize: MicroAdam's
# state is 4-bit codes and a sparse window, FRUGAL's a subspace's (tests/optim/test_{micro_adam,frugal}.py).
NO_MATRIX_SHAPED_STATE = {"micro_adam", "frugal"}
LAYERS, D, VOCAB, HEADS = 2, 48, 64, 4  # a stacked kernel of 2 x 48 x 48 = 4608 >= 4096: state_bits quantizes it
STEPS = 3
DEVICE = jax.devices()[0]
# Shampoo's roots from step 2 on; SOAP's first eigenbasis refresh (power iteration + QR, whose
# column sort can swap near-equal eigenvalue estimates) after the compared steps, at the 4th; the
# Muon family batches Newton-Schulz as on accelerators (CPU's default, per leaf: reference tests).
OVERRIDES = {
    "shampoo": {"precondition_every": 2},
    "soap": {"precondition_frequency": 3},
    **{name: {"ns_batching": "same_shape"} for name in ("muon", "normuon", "mars_muon", "muon_clip", "speedrun_muon")},
    "lopt": {"num_steps": 100},  # the run's length, which the registry gives it in training
}


def param_tree(name, dtype=jnp.float32):
    """The LM's parameter kinds under the LM's names, so the label functions route them as in training:
    a stacked hidden matrix, an unstacked one, an embedding and a norm scale; plus the key kernel
    for optimizers that take attention logits."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(0.1 * rng.standard_normal(shape), dtype)

    attn = {"q_proj": {"kernel": r(LAYERS, D, D)}}
    if "attn_max_logits" in registry.OPTIMIZERS[name].extra_args:
        attn["k_proj"] = {"kernel": r(LAYERS, D, D)}
    return {
        "embed": {"embedding": r(VOCAB, D)},
        "blocks": {"attn": attn},
        "mlp": {"up_proj": {"kernel": r(D, D)}},
        "final_norm": {"scale": r(D)},
    }


FSDP_SPECS = {  # by leaf name
    "embedding": jax.P("fsdp", None),
    "q_proj": jax.P(None, "fsdp", None),
    "k_proj": jax.P(None, None, "fsdp"),
    "up_proj": jax.P(None, "fsdp"),
    "final_norm": jax.P(),
}


def fsdp_shardings(tree, mesh):
    def spec(path, _):
        return jax.NamedSharding(mesh, next(v for k, v in FSDP_SPECS.items() if f"'{k}'" in jax.tree_util.keystr(path)))

    return jax.tree_util.tree_map_with_path(spec, tree)


def gradients(name, seed, dtype=jnp.float32):
    """bf16-representable random gradients of global norm < 0.5, under the registry's clip at 1 (so
    a bf16 run sees the fp32 run's values and no clip scale computed in bf16); every matrix has its
    singular values evenly spaced in [0.015, 0.03], so the eigenbases of SOAP's statistics are well
    conditioned (gaps of 1.6% of the norm) and 8 devices match one to float32 rounding."""
    rng = np.random.default_rng(100 + seed)

    def matrix(m, n):
        u, _ = np.linalg.qr(rng.standard_normal((m, m)))
        v, _ = np.linalg.qr(rng.standard_normal((n, n)))
        k = min(m, n)
        return (u[:, :k] * np.linspace(0.03, 0.015, k)) @ v[:, :k].T

    def leaf(p):
        if p.ndim < 2:
            return 0.005 * rng.standard_normal(p.shape)
        return np.reshape([matrix(*p.shape[-2:]) for _ in range(math.prod(p.shape[:-2]))], p.shape)

    return jax.tree.map(lambda p: jnp.asarray(leaf(p), jnp.bfloat16).astype(dtype), param_tree(name))


def extra_args(name, step, clipping=True):
    """The keyword arguments the optimizer's spec declares (``extra_args``) for step ``step``."""
    values = {}
    for arg in registry.OPTIMIZERS[name].extra_args:
        if arg != "attn_max_logits":
            raise KeyError(f"test_common.py has no value for the extra argument {arg!r} of {name}; add one")
        rng = np.random.default_rng(50 + step)  # heads above tau = 100 get clipped when ``clipping``
        values[arg] = jnp.float32(rng.uniform(50, 150 if clipping else 90, (LAYERS, HEADS)))
    return values


def optimizer_config(name, **common):
    config = default.optimizer_config(name)
    config.schedule, config.warmup_steps = "constant", 0
    for key, value in OVERRIDES.get(name, {}).items():
        config[name][key] = value
    for key, value in common.items():
        config[key] = value
    return config


def types(tree):
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def make_step(tx):
    """``(params, state, grads, extra) -> (params, state, updates)``; raises when traced a second
    time (under `jax.jit`, a state whose types change from one step to the next retraces)."""
    traces = []

    def step(params, state, grads, extra):
        traces.append(types(state))
        assert len(traces) == 1, f"retraced: state types {traces[0]} then {traces[-1]}"
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state, updates

    return step


@dataclasses.dataclass
class Run:
    tx: optax.GradientTransformation
    step: Callable
    params: list  # params[t]: after t steps
    states: list
    updates: list  # updates[t]: of step t + 1


@functools.cache
def base_run(name):
    """STEPS jitted steps of the registry-built optimizer on one device (committed to it, like a
    restored checkpoint, so both run the same executable)."""
    tx = build.build(optimizer_config(name), 100)
    step = jax.jit(make_step(tx))
    params = [jax.device_put(param_tree(name), DEVICE)]
    states = [jax.device_put(tx.init(params[0]), DEVICE)]
    updates = []
    for t in range(STEPS):
        p, s, u = step(params[-1], states[-1], gradients(name, t), extra_args(name, t))
        params.append(p)
        states.append(s)
        updates.append(u)
    return Run(tx, step, params, states, updates)


def all_finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact))


def floats(tree):
    """The floating leaves of ``tree`` (counters differ in where a schedule keeps its step)."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def assert_close(actual, expected, atol):
    """Leaf by leaf, to ``atol`` times the leaf's largest entry."""
    for a, e in zip(actual, expected, strict=True):
        e = np.asarray(e, np.float64)
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=0, atol=atol * np.max(np.abs(e), initial=0.0))


@pytest.mark.parametrize("name", NAMES)
def test_jitted_steps_are_finite_and_keep_the_state_types(name):
    run = base_run(name)  # make_step raises if a step's state types differ from the last and force a retrace
    init_types = types(jax.eval_shape(run.tx.init, param_tree(name)))
    for state in run.states[1:]:
        assert types(state) == init_types
    assert all(all_finite(u) for u in run.updates)
    for path, u in jax.tree_util.tree_leaves_with_path(run.updates[-1]):  # every parameter moves
        assert float(jnp.max(jnp.abs(u))) > 0, jax.tree_util.keystr(path)


@pytest.mark.devices(8)
@pytest.mark.parametrize("name", NAMES)
def test_injected_on_8_fsdp_devices_matches_plain_on_1_device(name):
    """Two equivalences in one compiled program (programs are what cost): the public function under
    `optax.inject_hyperparams` (every numeric hyperparameter a float32 array in the state), on 8
    devices with FSDP-sharded parameters and state, steps like `base_run`; state that mirrors a
    parameter is sharded like it; and the injected learning rate is live."""
    run = base_run(name)
    cls = registry.OPTIMIZERS[name]
    inject = optax.inject_hyperparams(spec.function(cls, name=name), static_args=cls.static_args)
    lr = spec.defaults(cls)["learning_rate"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), inject(learning_rate=lr, **OVERRIDES.get(name, {})))
    tree = param_tree(name)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        p_shard = fsdp_shardings(tree, mesh)
        abstract = blocking.annotate_block_shardings(jax.eval_shape(tx.init, tree), mesh)
        s_shard = partition.state_shardings(abstract, tree, p_shard, mesh)
        params = jax.device_put(tree, p_shard)
        state = jax.jit(tx.init, out_shardings=s_shard)(params)
        step = jax.jit(make_step(tx), out_shardings=(p_shard, s_shard, p_shard))
        for t in range(STEPS + 1):
            if t == STEPS:  # the injected learning rate, set to 0, stops every parameter
                lr_leaf = state[1].hyperparams["learning_rate"]
                state[1].hyperparams["learning_rate"] = jax.device_put(jnp.zeros_like(lr_leaf), lr_leaf.sharding)
            grads = jax.device_put(gradients(name, t), p_shard)
            params, state, updates = step(params, state, grads, extra_args(name, t, clipping=t < STEPS))
            if t < STEPS:
                # Measured on CPU: 2e-6 (params), 1.3e-5 (state) of each leaf's largest entry.
                assert_close(jax.tree.leaves(params), jax.tree.leaves(run.params[t + 1]), atol=2e-5)
                assert_close(floats(state[1].inner_state), floats(run.states[t + 1]), atol=1e-4)
    assert float(state[1].hyperparams["learning_rate"]) == 0.0
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    by_path = {jax.tree_util.keystr(k): p for k, p in jax.tree_util.tree_leaves_with_path(params)}
    mirrored = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state[1].inner_state):
        for key, p in by_path.items():
            if jax.tree_util.keystr(path).endswith(key) and leaf.shape == p.shape:
                assert leaf.sharding.is_equivalent_to(p.sharding, leaf.ndim), jax.tree_util.keystr(path)
                mirrored += 1
    assert mirrored >= len(by_path) or name in NO_MATRIX_SHAPED_STATE


def dequantized(state):
    """``state`` with each `QuantizedState` as its inner state, quantized leaves decoded in place."""
    is_wrapped = lambda x: isinstance(x, QuantizedState)  # noqa: E731
    state = jax.tree.map(lambda x: x.view() if is_wrapped(x) else x, state, is_leaf=is_wrapped)
    return jax.tree.map(lambda x: qz.dequantize(x) if qz.is_quantized(x) else x, state, is_leaf=qz.is_quantized)


@pytest.mark.parametrize("name", NAMES)
def test_state_bits_8_and_cautious_compose_on_bf16_parameters(name):
    """bf16 parameters stay bf16 and the state keeps its types; cautious keeps only update entries of
    the descent sign (no QK-clip here: logits under tau); the 8-bit state tracks the fp32 state of
    `base_run`, which neither the mask nor the parameters' dtype touch (same gradient values)."""
    tx = build.build(optimizer_config(name, state_bits=8, cautious=True), 100)
    params = param_tree(name, jnp.bfloat16)
    state = tx.init(params)
    init_types = types(state)
    assert name in NO_MATRIX_SHAPED_STATE or any(qz.is_quantized(x) for x in jax.tree.leaves(state, is_leaf=qz.is_quantized))
    step = jax.jit(make_step(tx))
    for t in range(2):
        grads = gradients(name, t, jnp.bfloat16)
        params, state, updates = step(params, state, grads, extra_args(name, t, clipping=False))
        assert types(state) == init_types and all_finite(updates) and all_finite(dequantized(state))
        assert {x.dtype for x in jax.tree.leaves((params, updates))} == {jnp.dtype(jnp.bfloat16)}
        for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), strict=True):
            assert bool(jnp.all(u * g <= 0)) and bool(jnp.any(u != 0))
        if t == 0:  # the dynamic 8-bit code's half gap, 0.7% of a block's largest entry, + bf16 moments
            assert_close(floats(dequantized(state)), floats(base_run(name).states[1]), atol=0.02)


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trips_through_a_checkpoint(name, tmp_path):
    run = base_run(name)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", run.states[2])
        checkpointer.wait_until_finished()
        device = jax.sharding.SingleDeviceSharding(DEVICE)
        abstract = jax.eval_shape(run.tx.init, param_tree(name))
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
        restored = checkpointer.restore(tmp_path / "state", target)
    assert jax.tree.structure(restored) == jax.tree.structure(run.states[2])
    params, state, updates = run.step(run.params[2], restored, gradients(name, 2), extra_args(name, 2))
    for got, want in ((params, run.params[3]), (state, run.states[3]), (updates, run.updates[2])):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_zero_tiny_and_huge_gradients_keep_the_state_finite(name):
    """Through the registry's default gradient clipping, as training runs it: per-leaf gradient
    scales drawn from {0, 1e-30, 1, 1e30}, from a fresh and from a used state."""
    run = base_run(name)
    rng = np.random.default_rng(7)
    params, state = run.params[0], run.states[0]
    scales = [0.0, 1e-30, 1e30, *([None] * 5)]  # the whole tree at one scale, then mixed per leaf
    for t, scale in enumerate(scales * 2):
        if t == len(scales):
            params, state = run.params[2], run.states[2]
        leaves, treedef = jax.tree.flatten(gradients(name, t))
        picks = [scale if scale is not None else rng.choice([0.0, 1e-30, 1.0, 1e30]) for _ in leaves]
        grads = treedef.unflatten([jnp.float32(s) * g for s, g in zip(picks, leaves, strict=True)])
        params, state, updates = run.step(params, state, grads, extra_args(name, t))
        assert all_finite(state) and all_finite(updates), (t, picks)


def test_train_step_skips_a_step_whose_optimizer_state_overflows(monkeypatch):
    """Finite gradients of ~1e30 (a z-loss spike, no clipping) overflow AdamW's second moment to inf
    while its update stays finite (m / sqrt(inf) = 0): the train step skips the step. The step's
    logic runs on a bigram model standing in for the LM (which would only add compile time)."""

    def bigram(model_def, params, tokens, return_aux=False, model_layout=False, window_blocks=None):
        logits = params["embed"]["embedding"][tokens] @ params["head"]["kernel"]
        return (logits, {}) if return_aux else logits

    monkeypatch.setattr(train_lib.model_lib, "apply", bigram)
    monkeypatch.setattr(train_lib.model_lib, "in_model_layout", lambda model_def, x: x)
    rng = np.random.default_rng(0)
    params = {
        "embed": {"embedding": jnp.float32(rng.normal(size=(32, 8)))},
        "head": {"kernel": jnp.float32(rng.normal(size=(8, 32)))},
    }
    tx = build.build(optimizer_config("adamw", grad_clip_norm=0.0), 100)
    counters = {k: jnp.zeros((), jnp.int32) for k in ("step", "bad_streak", "skipped")}
    state = {"params": params, "opt_state": tx.init(params), **counters}
    stand_in = SimpleNamespace(config=ModelConfig(vocab_size=32))  # what the step reads of a model besides `apply`
    step = jax.jit(train_lib.make_train_step(stand_in, tx, z_loss=1e30))
    new, metrics = step(state, jnp.asarray(rng.integers(0, 32, (2, 9)), jnp.int32))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["update_norm"]))
    assert not bool(metrics["finite"]) and (int(new["skipped"]), int(new["bad_streak"])) == (1, 1)
    for a, b in zip(jax.tree.leaves(new["opt_state"]), jax.tree.leaves(state["opt_state"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_config_blocks_and_public_functions_come_from_the_specs():
    config = default.optimizer_config()
    for name, cls in registry.OPTIMIZERS.items():
        fields = spec.defaults(cls)
        keys = spec.config_defaults(cls)
        assert config[name].to_dict() == {k: keys[k] if k == "inner" else v for k, v in fields.items() if k in keys}
        assert set(inspect.signature(spec.function(cls, name=name)).parameters) == set(fields)
    assert {n for n, c in registry.OPTIMIZERS.items() if "attn_max_logits" in c.extra_args} == {"muon_clip"}
    config.name = "muon"
    config.muon.bogus = 1.0
    with pytest.raises(ValueError, match="optimizer.muon has no key.s. bogus; its keys: adam_b1"):
        build.build(config, 10)
