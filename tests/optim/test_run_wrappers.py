"""The optimizer-track wrappers (optim/{cautious_weight_decay,lookahead,tail_average,run_wrappers}.py)
against NumPy transcriptions of the paper / modded-nanogpt record's loops, and as config settings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import default
from optim import build
from optim.cautious_weight_decay import CautiousWeightDecayState, cautious_weight_decay
from optim.lookahead import LookaheadState, lookahead
from optim.tail_average import TailAverageState, evaluation_params, tail_average

STEPS = 6
RNG = np.random.default_rng(0)
A = RNG.standard_normal((12, 5))
B = RNG.standard_normal((12, 3))
W0 = 0.5 * RNG.standard_normal((5, 3))


def grad(w):
    """Gradient of 0.5 ||A w - B||^2 / 12 (float64 for the transcriptions, float32 for JAX)."""
    return A.T @ (A @ w - B) / 12


def find(state, kind):
    """The state of the wrapper ``kind`` inside an optimizer state."""
    return next((s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, kind)) if isinstance(s, kind)), None)


def run_jax(tx, steps=STEPS):
    params = {"w": jnp.float32(W0)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        g = jax.tree.map(lambda w: jnp.float32(A.T) @ (jnp.float32(A) @ w - jnp.float32(B)) / 12, params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    out = []
    for _ in range(steps):
        params, state = step(params, state)
        out.append(np.asarray(params["w"], np.float64))
    return out, params, state


def test_cautious_weight_decay_matches_the_paper_step():
    """Chen et al. (arXiv:2510.12402) Algorithm 1: x <- x - eta_t (u + lambda 1[u x >= 0] x), u the inner direction."""
    schedule = optax.linear_schedule(0.1, 0.02, STEPS)
    lam = 0.5
    inner = optax.chain(optax.trace(0.9), optax.scale_by_schedule(lambda n: -schedule(n)))
    actual, _, _ = run_jax(cautious_weight_decay(inner, lam, schedule, mask={"w": True}))
    w, buf, expected = W0.copy(), np.zeros_like(W0), []
    for t in range(STEPS):
        eta = float(schedule(t))
        buf = 0.9 * buf + grad(w)
        w = w - eta * (buf + lam * (buf * w >= 0) * w)
        expected.append(w)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert 0 < np.mean(buf * w >= 0) < 1  # both kinds of entries occur


def test_lookahead_matches_the_records_ema_nesterov_loop():
    """modded-nanogpt f411b3d ``EMA_Nesterov``: nesterov_step (p += beta_n buf), the gradient at p, the inner
    step, accum_lookahead (buf <- lerp(buf, p - prev, 1 - ema); prev <- p); beta_n = stepsize * lr_{n-1} / lr_max
    for prefill <= n < rest."""
    schedule = optax.linear_schedule(0.05, 0.01, STEPS)
    stepsize, ema, start, stop = 0.6, 0.8, 1, 5
    inner = optax.chain(optax.trace(0.9), optax.scale_by_schedule(lambda n: -schedule(n)))
    tx = lookahead(inner, stepsize, ema=ema, start=start, stop=stop, ratio=lambda n: schedule(n) / 0.05)
    actual, params, state = run_jax(tx)
    p, prev, buf, trace, live = W0.copy(), W0.copy(), np.zeros_like(W0), np.zeros_like(W0), []
    for n in range(STEPS):
        if start <= n < stop:
            p = p + stepsize * float(schedule(max(n - 1, 0))) / 0.05 * buf
        live.append(p)  # the weights the gradient is taken at
        trace = 0.9 * trace + grad(p)
        p = p - float(schedule(n)) * trace
        buf = ema * buf + (1 - ema) * (p - prev)
        prev = p.copy()
    # the train step holds the next lookahead point; the state keeps the record's p (prev) for evaluation
    np.testing.assert_allclose(actual[:-1], live[1:], rtol=1e-5, atol=1e-6)
    look = find(state, LookaheadState)
    np.testing.assert_allclose(np.asarray(look.x["w"]), prev, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(evaluation_params(params, state)["w"]), prev, rtol=1e-5, atol=1e-6)


def test_tail_average_is_the_records_tail_ema_readout():
    """modded-nanogpt f411b3d ``TAILEMA``: at step+1 == start the EMA is the weights, then ema += (w - ema) / tau
    while step+1 < end; eval = (1 - blend) w + blend ema. Training is unchanged."""
    lr, start, horizon, blend, stop = 0.05, 2, 3.0, 0.6, 5
    plain, _, _ = run_jax(optax.sgd(lr, 0.9))
    actual, params, state = run_jax(tail_average(optax.sgd(lr, 0.9), start=start, horizon=horizon, blend=blend, stop=stop))
    np.testing.assert_allclose(actual, plain, rtol=0, atol=0)
    ema = None
    for step, w in enumerate(plain):
        if start <= step + 1 < stop:
            ema = w.copy() if ema is None else ema + (w - ema) / horizon
    np.testing.assert_allclose(np.asarray(evaluation_params(params, state)["w"]), (1 - blend) * plain[-1] + blend * ema, rtol=1e-5)
    before = tail_average(optax.sgd(lr), start=STEPS + 1)
    _, params, state = run_jax(before)
    np.testing.assert_array_equal(evaluation_params(params, state)["w"], params["w"])  # not started: the weights


def config(name, **settings):
    c = default.optimizer_config(name)
    c.schedule, c.warmup_steps, c.grad_clip_norm = "constant", 0, 0.0
    for key, value in settings.items():
        c[key] = value
    return c


def test_settings_wrap_any_registered_optimizer():
    params = {"blocks": {"mlp": {"up_proj": {"kernel": jnp.float32(0.1 * RNG.standard_normal((2, 8, 8)))}}}, "final_norm": {"scale": jnp.ones(8)}}
    grads = jax.tree.map(lambda p: jnp.float32(RNG.standard_normal(p.shape)), params)
    for name in ("adamw", "muon"):
        c = config(name, cautious_weight_decay=0.1)
        c.lookahead.stepsize = 0.3
        c.tail_average.start = 1
        tx = build.build(c, total_steps=10)
        state = tx.init(params)
        updates, state = jax.jit(tx.update)(grads, state, params)
        assert find(state, LookaheadState) and find(state, CautiousWeightDecayState), name
        tail = find(state, TailAverageState)
        x = find(state, LookaheadState).x  # the weights without the lookahead: what the average starts from
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), tail.average, x)
        ahead = jax.tree.map(lambda p, u: p + u, params, updates)  # the next lookahead point: x + beta b
        assert np.max(np.abs(ahead["final_norm"]["scale"] - x["final_norm"]["scale"])) > 1e-6
        # the optimizer's own uniform decay is off: with the cautious decay at 0, the update is the plain optimizer's
        off = config(name, weight_decay=0.0)
        plain, _ = build.build(off, total_steps=10).update(grads, build.build(off, total_steps=10).init(params), params)
        zero = build.build(config(name, cautious_weight_decay=1e-30), total_steps=10)
        same, _ = zero.update(grads, zero.init(params), params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), same, plain)
    with pytest.raises(ValueError, match="replaces optimizer.weight_decay"):
        build.build(config("adamw", cautious_weight_decay=0.1, weight_decay=0.1), total_steps=10)
    bad = config("adamw")
    bad.lookahead.gamma = 0.9
    with pytest.raises(ValueError, match="optimizer.lookahead has no key"):
        build.build(bad, total_steps=10)
