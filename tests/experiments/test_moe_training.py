"""MoE models in the train step: Muon trains `moe-tiny`; the global balancing scope counts every micro-batch."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train_lib
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib
from lm import moe
from optim import build

STEPS = 8


def _state(model_def, tx):
    zero = jnp.zeros((), jnp.int32)
    params = model_lib.init_params(model_def, 0)
    return {"params": params, "opt_state": tx.init(params), "step": zero, "bad_streak": zero, "skipped": zero}


def _batch(rows: int, seq: int) -> jnp.ndarray:
    """Rows of a short repeated random motif each: learnable in a few steps."""
    rng = np.random.default_rng(0)
    motifs = rng.integers(0, 256, (rows, 5))
    return jnp.asarray(np.tile(motifs, seq // 5 + 1)[:, : seq + 1], jnp.int32)


@pytest.fixture(scope="module")
def muon_history():
    model_def = model_lib.define(config_lib.from_preset("moe-tiny"))
    config = default.optimizer_config("muon")
    config.update(schedule="constant", warmup_steps=0)
    tx = build.build(config, STEPS)
    step = jax.jit(train_lib.make_train_step(model_def, tx, balancing=moe.Balancing(bias_rate=1e-3)))
    state, batch = _state(model_def, tx), _batch(8, 64)
    bias0 = np.asarray(state["params"]["blocks"]["mlp"]["router"]["bias"])
    history = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return history, bias0, np.asarray(state["params"]["blocks"]["mlp"]["router"]["bias"])


def test_muon_trains_moe_tiny(muon_history):
    history, bias0, bias = muon_history
    losses = [float(m["loss"]) for m in history]
    assert all(np.isfinite(losses)) and not any(int(m["skipped"]) for m in history)
    assert losses[-1] < losses[0] - 1.5, losses
    for m in history:
        assert float(m["dropped_fraction"]) == 0.0  # dropless: no token slot is ever dropped
        assert np.isfinite(float(m["moe_balance_loss"])) and float(m["router_z_loss"]) > 0
    # The bias moves by exactly +-rate (or 0) per step, outside the gradient.
    steps_taken = np.abs(bias - bias0) / 1e-3
    assert np.all(steps_taken <= STEPS + 1e-3) and np.any(steps_taken > 0)


def test_global_scope_sums_the_counts_of_every_micro_batch():
    cfg = config_lib.from_preset("moe-tiny", n_layers=1)
    model_def = model_lib.define(cfg)
    config = default.optimizer_config("adamw")
    config.update(schedule="constant", warmup_steps=0)
    tx = build.build(config, 10)
    balancing = moe.Balancing(bias_rate=0.25)
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 17)), jnp.int32)
    out = {}
    for accum in (1, 2):
        step = jax.jit(train_lib.make_train_step(model_def, tx, grad_accum_steps=accum, balancing=balancing))
        state, metrics = step(_state(model_def, tx), batch)
        out[accum] = (np.asarray(state["params"]["blocks"]["mlp"]["router"]["bias"]), float(metrics["expert_load_max"]))
    # Routing does not depend on how the batch is cut: the step's counts, hence the bias step and loads, agree.
    np.testing.assert_array_equal(out[1][0], out[2][0])
    assert out[1][1] == pytest.approx(out[2][1])
    assert set(np.unique(np.abs(out[1][0]))) <= {0.0, 0.25}
