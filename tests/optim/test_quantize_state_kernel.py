"""quantize_state's fused kernel: the same state and updates as the XLA path, the choice of path, a tiny LM run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kernels_pallas.quantized_update as qu
from experiments import run_spec, trainer
from experiments.configs import default
from optim import build, labels
from optim import quantization as qz
from optim.quantize_state import Fused, quantize_state


SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)
LION = Fused(qu.Lion(b1=0.9, b2=0.99, weight_decay=0.5), SCHEDULE)


def _lion(kernel, **kwargs):
    inner = optax.lion(SCHEDULE, b1=0.9, b2=0.99, weight_decay=0.5, mask=labels.decay_mask)
    return quantize_state(inner, 8, kernel=kernel, fused=LION, interpret=jax.default_backend() == "cpu", mask=lambda p: {"w": True, "b": True, "s": False}, **kwargs)


def _has_kernel(tx, grads, state, params) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(tx.update)(grads, state, params))


def test_kernel_path_equals_xla_path_over_steps():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(40, 72)), jnp.float32), "b": jnp.asarray(rng.normal(size=(300,)), jnp.float32), "s": jnp.ones(8)}
    xla, pallas = _lion("xla", stochastic_rounding=True, seed=1), _lion("pallas", stochastic_rounding=True, seed=1)
    s_xla, s_pallas = xla.init(params), pallas.init(params)
    assert jax.tree.structure(s_xla) == jax.tree.structure(s_pallas)  # one state format: checkpoints move
    p_xla = p_pallas = params
    step_xla, step_pallas = jax.jit(xla.update), jax.jit(pallas.update)
    assert _has_kernel(pallas, params, s_pallas, params) and not _has_kernel(xla, params, s_xla, params)
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        u_xla, s_xla = step_xla(grads, s_xla, p_xla)
        u_pallas, s_pallas = step_pallas(grads, s_pallas, p_pallas)
        for a, b in zip(jax.tree.leaves(s_xla), jax.tree.leaves(s_pallas), strict=True):
            if a.dtype == jnp.uint8:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-6)
        p_xla, p_pallas = optax.apply_updates(p_xla, u_xla), optax.apply_updates(p_pallas, u_pallas)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p_xla, p_pallas)
    assert qz.is_quantized(s_pallas.view()[0].mu["b"]) and not qz.is_quantized(s_pallas.view()[0].mu["s"])


def test_auto_falls_back_to_xla_without_a_kernel_or_a_rule():
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones(8), "s": jnp.ones(8)}
    lion, sgd = _lion("auto"), quantize_state(optax.sgd(0.1, momentum=0.9), 8, kernel="auto")
    assert _has_kernel(lion, params, lion.init(params), params) == qu.available()  # False on CPU
    assert not _has_kernel(sgd, params, sgd.init(params), params)
    with pytest.raises(ValueError, match="kernel='pallas' needs fused="):
        quantize_state(optax.sgd(0.1, momentum=0.9), 8, kernel="pallas")
    with pytest.raises(ValueError, match="use one of auto, xla, pallas"):
        quantize_state(optax.sgd(0.1), 8, kernel="triton")


def _lm_config(kernel):
    """`tiny` with 8-bit Lion state, FSDP over 8 devices: the kernel runs per shard (train passes the specs)."""
    config = default.get_config()
    config.steps = 2
    config.data.seq_len = 32
    config.batch_size = 8
    config.eval_every = 2
    config.eval_batches = 1
    config.log_every = 1
    config.checkpoint_every = 1000
    config.optimizer.name = "lion"
    config.optimizer.warmup_steps = 0
    config.optimizer.state_bits = 8
    config.optimizer.state_kernel = kernel
    config.mesh, config.rules = "fsdp:8", "fsdp"
    return config


def _losses(workdir):
    with open(workdir / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


@pytest.mark.devices(8)
def test_tiny_lm_under_fsdp_with_the_kernel_matches_xla(tmp_path):
    spec = run_spec.build_run(_lm_config("pallas"))  # what trainer.run builds: the kernel inside a shard_map over fsdp
    params = {"w": jnp.ones((128, 64))}  # 16 rows per shard: whole 16 x 16 tiles
    tx = build.build(_lm_config("pallas").optimizer, 2, param_specs={"w": jax.P("fsdp", None)})
    with jax.set_mesh(spec.mesh):
        jaxpr = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    runs = {}
    for kernel in ("xla", "pallas"):
        workdir = tmp_path / kernel
        trainer.run(_lm_config(kernel), workdir)
        runs[kernel] = _losses(workdir)
    assert len(runs["xla"]) == 2
    np.testing.assert_allclose(runs["pallas"], runs["xla"], rtol=1e-5)
