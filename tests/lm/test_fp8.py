"""FP8 matrix products (lm/fp8.py): the numerics against an upcast NumPy reference, the train step's
handling of delayed scaling's state, sharded runs and checkpoints, and the GPU program lowered on the host."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from experiments import checkpointing, run_spec, train_lib
from experiments.configs import default
from kernels_pallas import backends
from lm import config as config_lib
from lm import fp8
from lm import model as model_lib
from lm.loss import next_token_loss

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
MICRO = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "head_dim": 16, "mlp_dim": 64, "max_seq_len": 32, "attention": "xla"}
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ---------------------------------------------------------------- the NumPy reference (from the definitions)


def ref_scale(amax, previous, fmt):
    """``s = amax / max_F`` (written ``1 / (max_F / amax)``, as Transformer Engine and flax compute it); ``previous`` if amax is 0."""
    fmax = np.float32(float(ml_dtypes.finfo(fmt).max))
    return np.float32(1) / (fmax / np.float32(amax)) if amax > 0 else np.float32(previous)


def ref_quantize(a, fmt, scale):
    """``cast_F(clip(a / s, -max_F, max_F))``, upcast back to float32."""
    fmax = np.float32(float(ml_dtypes.finfo(fmt).max))
    return np.clip(a / scale, -fmax, fmax).astype(fmt).astype(np.float32)


def ref_history(history, amax):
    """The window after a step: the oldest entry dropped, ``amax`` in front (Transformer Engine's roll, then slot 0)."""
    out = np.roll(history, -1)
    out[0] = amax
    return out


def reference(x, w, g, grad_fmt, state):
    """``y, dx, dw`` and (delayed) the new state, every product of upcast fp8 values in float32."""
    amax = {"input": np.abs(x).max(), "kernel": np.abs(w).max(), "output_grad": np.abs(g).max()}
    fmts = {"input": E4M3, "kernel": E4M3, "output_grad": grad_fmt}
    scales, new = {}, {}
    for name, fmt in fmts.items():
        if state:
            scales[name] = ref_scale(state[f"{name}_amax_history"].max(), state[f"{name}_scale"][0], fmt)
            new |= {f"{name}_scale": np.array([scales[name]]), f"{name}_amax_history": ref_history(state[f"{name}_amax_history"], amax[name])}
        else:
            scales[name] = ref_scale(amax[name], 1.0, fmt)
    qx, qw, qg = (ref_quantize(a, fmts[n], scales[n]) for a, n in ((x, "input"), (w, "kernel"), (g, "output_grad")))
    sx, sw, sg = scales["input"], scales["kernel"], scales["output_grad"]
    return (qx @ qw) * (sx * sw), (qg @ qw.T) * (sg * sw), (qx.T @ qg) * (sx * sg), new


@pytest.mark.parametrize("delayed, grad_fmt", [(False, E4M3), (True, E5M2)], ids=["current-e4m3", "delayed-hybrid"])
def test_products_equal_the_upcast_reference_exactly(delayed, grad_fmt):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 16)) * 3).astype(np.float32)
    w = (rng.standard_normal((16, 12)) * 0.1).astype(np.float32)
    g = (rng.standard_normal((8, 12)) * 1e-3).astype(np.float32)
    state = {}
    if delayed:  # windows of 4 steps; the input's is below its amax now, so its largest values clip
        for name, amax in (("input", 2.0), ("kernel", 0.3), ("output_grad", 4e-3)):
            state[f"{name}_amax_history"] = (rng.uniform(0.2, 1.0, 4) * amax).astype(np.float32)
            state[f"{name}_scale"] = np.array([0.5], np.float32)

    def products(x, w, state):
        y, pullback = jax.vjp(lambda x, w, s: fp8.scaled_matmul(x, w, s, jnp.dtype(grad_fmt)), x, w, state)
        return y, *pullback(jnp.asarray(g))

    y, dx, dw, new_state = jax.jit(products)(x, w, state)
    ry, rdx, rdw, r_state = reference(x, w, g, grad_fmt, state)
    if delayed:
        assert np.abs(x).max() / ref_scale(state["input_amax_history"].max(), 1, E4M3) > float(ml_dtypes.finfo(E4M3).max)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert jax.tree.map(np.asarray, new_state).keys() == r_state.keys()
    for key, want in r_state.items():
        np.testing.assert_array_equal(np.asarray(new_state[key]), want, err_msg=key)


def test_scaling_state_combines_by_maximum_and_is_kept_from_the_optimizer():
    """`accumulate` sums gradients and takes the maximum of new scaling state; `exclude_scaling` hides it from ``tx``."""
    grads = lambda k, h: {"a": {"kernel": jnp.full((2,), k), "dot_general": {"input_amax_history": jnp.array(h)}}}
    total = fp8.accumulate(grads(1.0, [3.0, 1.0]), grads(2.0, [2.0, 5.0]))
    assert total["a"]["kernel"].tolist() == [3.0, 3.0] and total["a"]["dot_general"]["input_amax_history"].tolist() == [3.0, 5.0]
    assert fp8.mean(total, 0.5)["a"]["dot_general"]["input_amax_history"].tolist() == [3.0, 5.0]
    params = grads(1.0, [0.0, 0.0])
    tx = fp8.exclude_scaling(optax.sgd(1.0))
    updates, _ = tx.update(grads(2.0, [4.0, 4.0]), tx.init(params), params)
    assert updates["a"]["kernel"].tolist() == [-2.0, -2.0] and updates["a"]["dot_general"]["input_amax_history"].tolist() == [0.0, 0.0]
    assert fp8.overwrite(params, grads(2.0, [4.0, 4.0]))["a"]["dot_general"]["input_amax_history"].tolist() == [4.0, 4.0]


def test_config_checks_name_the_fix():
    with pytest.raises(ValueError, match="model.fp8='fp4' must be one of none, e4m3, hybrid"):
        config_lib.from_preset("tiny", fp8="fp4")
    with pytest.raises(ValueError, match="tie_embeddings=False and model.loss_chunk=none"):
        config_lib.from_preset("tiny", fp8="hybrid", fp8_head=True)


# ---------------------------------------------------------------- the train step, meshes and checkpoints


def _run_config(mesh, rules="fsdp", devices=0):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len, config.devices = 3, 8, 16, devices
    config.model.update({k: v for k, v in MICRO.items() if k != "max_seq_len"} | {"fp8": "hybrid", "fp8_amax_history": 4})
    config.mesh, config.rules = mesh, rules
    return config


def _compiled_step(model_def, tx):
    return jax.jit(train_lib.make_train_step(model_def, tx), compiler_options=FAST_COMPILE)


def _run(step, mesh, state, batches):
    """The states after each of ``batches`` (``state`` first) and the losses."""
    states, losses = [state], []
    with jax.set_mesh(mesh):
        for batch in batches:
            state, metrics = step(state, jnp.asarray(batch))
            states.append(state)
            losses.append(float(metrics["loss"]))
    return states, losses


BATCHES = np.random.default_rng(2).integers(0, 64, (3, 8, 17)).astype(np.int32)


@pytest.fixture(scope="module")
def one_device():
    """A `hybrid` delayed-scaling run on one device (built as `trainer.run` builds it): spec, step, states, losses."""
    spec = run_spec.build_run(_run_config("data:1", devices=1))
    with jax.set_mesh(spec.mesh):
        state = train_lib.init_state(spec.model_def, spec.tx, 0, spec.shardings)
    step = _compiled_step(spec.model_def, spec.tx)
    return spec, step, *_run(step, spec.mesh, state, BATCHES)


def test_train_step_writes_the_scaling_state_and_trains_like_the_unquantised_model(one_device):
    """Step 1 records the amaxes (scales stay 1), step 2 scales by them, the optimizer state is the model's
    without FP8, and over 3 steps the loss stays within 0.02 nats of the unquantised model's from the same start."""
    spec, _, states, losses = one_device
    base_def = model_lib.define(dataclasses.replace(spec.cfg, fp8="none"))
    assert jax.tree.structure(states[0]["opt_state"]) == jax.tree.structure(jax.eval_shape(spec.tx.init, base_def.abstract_params))
    mlp = lambda s: s["params"]["blocks"]["mlp"]["up_proj"]  # stacked over the one layer
    scaling = mlp(states[1])["dot_general"]
    assert float(scaling["kernel_amax_history"][0, 0]) == np.abs(np.asarray(mlp(states[0])["kernel"])).max()  # step 0's weight
    for name in ("input", "kernel", "output_grad"):
        history = np.asarray(scaling[f"{name}_amax_history"][0])
        assert history[0] > 0 and not history[1:].any() and float(scaling[f"{name}_scale"][0, 0]) == 1.0
        fmt = E5M2 if name == "output_grad" else E4M3
        assert float(mlp(states[2])["dot_general"][f"{name}_scale"][0, 0]) == ref_scale(history.max(), 1.0, fmt)

    base_state = {**states[0], "params": fp8.split(states[0]["params"])[0]}  # the same initial weights and moments
    _, base_losses = _run(_compiled_step(base_def, spec.tx), spec.mesh, base_state, BATCHES)
    assert np.max(np.abs(np.array(losses) - np.array(base_losses))) < 0.02, (losses, base_losses)


@pytest.mark.devices(8)
def test_fsdp_and_tensor_parallel_equal_one_device_and_checkpoints_restore_on_another_mesh(one_device, tmp_path):
    """Two steps on ``fsdp:2,tensor:4`` equal one device's (scaling state included); the saved state restores
    exactly on one device and trains on there as the sharded run does."""
    one, one_step, ref_states, ref_losses = one_device
    sharded = run_spec.build_run(_run_config("fsdp:2,tensor:4", rules="tp"))
    step = _compiled_step(sharded.model_def, sharded.tx)
    states, losses = _run(step, sharded.mesh, jax.device_put(ref_states[0], sharded.shardings.state), BATCHES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got, want = (jax.tree.map(np.asarray, s["params"]) for s in (states[2], ref_states[2]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)
    assert states[2]["params"]["blocks"]["attn"]["q_proj"]["dot_general"]["output_grad_amax_history"].sharding.is_fully_replicated

    mgr = checkpointing.manager(tmp_path, keep=1, every=1)
    checkpointing.save(mgr, 2, states[2], {}, {}, force=True)
    mgr.wait_until_finished()
    _, restored, _ = checkpointing.restore(mgr, train_lib.abstract_state(one.model_def, one.tx, one.shardings), {})
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, states[2]))
    _, resumed = _run(one_step, one.mesh, restored, BATCHES[2:])
    np.testing.assert_allclose(resumed, losses[2:], rtol=1e-5)


# ---------------------------------------------------------------- the GPU program


def test_gpu_program_multiplies_in_fp8():
    """Lowered for an H100 on this host: every projection's forward product takes e4m3 operands, and its
    two backward products an e5m2 gradient (``hybrid``), the LM head's too with ``fp8_head``."""
    cfg = config_lib.ModelConfig(**MICRO, dtype="bfloat16", fp8="hybrid", fp8_head=True, tie_embeddings=False, loss_chunk="none")
    model_def = model_lib.define(cfg)
    tokens = jax.ShapeDtypeStruct((2, 17), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, t: next_token_loss(model_def, p, t)[0]))
    try:
        with backends.gpu_target():
            text = grad.trace(model_def.abstract_params, tokens).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001  (a jax without host lowering for CUDA)
        pytest.skip(f"this jax cannot lower for cuda on a CPU host: {e}")
    dots = [line.split(":")[-1] for line in text.splitlines() if "stablehlo.dot_general" in line]
    operands = [tuple(t.split("x")[-1].rstrip(">") for t in d.split("->")[0].strip(" ()").split(", ")) for d in dots]
    projections = 7 + 1  # q, k, v, o, gate, up, down; the head
    assert operands.count(("f8E4M3FN", "f8E4M3FN")) == projections
    assert operands.count(("f8E5M2", "f8E4M3FN")) == projections  # dx = g W^T
    assert operands.count(("f8E4M3FN", "f8E5M2")) == projections  # dW = x^T g
