"""Matrix optimizers and quantized states treat a stacked expert axis as a batch axis.

An MoE layer stores its experts as one ``(experts, fan_in, fan_out)`` leaf; each expert must be
updated exactly as if it were its own ``(fan_in, fan_out)`` matrix (no orthogonalisation, block,
preconditioner or quantization tile spanning two experts).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import default
from optim import build

E, D, F = 2, 64, 64  # each expert has 4096 entries: quantized like the stack (default min_size)


def _train(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("name,state_bits", [("muon", 0), ("shampoo", 0), ("adamw", 8)])
def test_expert_stack_is_updated_like_separate_matrices(name, state_bits):
    config = default.optimizer_config(name, learning_rate=0.02)
    config.update(state_bits=state_bits, grad_clip_norm=0.0, schedule="constant", warmup_steps=0)
    tx = build.build(config, 10)
    rng = np.random.default_rng(0)
    stack = jnp.float32(rng.normal(size=(E, D, F)))
    grads = [jnp.float32(rng.normal(size=(E, D, F))) for _ in range(2)]
    stacked = jax.jit(_train, static_argnums=0)(tx, {"w": stack}, [{"w": g} for g in grads])["w"]
    split = jax.jit(_train, static_argnums=0)(tx, {f"w{e}": stack[e] for e in range(E)}, [{f"w{e}": g[e] for e in range(E)} for g in grads])
    assert not np.allclose(stacked, stack)
    np.testing.assert_allclose(stacked, jnp.stack([split[f"w{e}"] for e in range(E)]), rtol=1e-5, atol=1e-6)
