"""Every registered optimizer trains on ``fsdp:8``, and its checkpoint resumes on one device and on a TP mesh.

Each case trains a micro `tiny` LM on ``fsdp:8`` with the optimizer's registry defaults, saves at
step 2 through `experiments.checkpointing`, and goes on to step 5: the uninterrupted reference,
which must lower the loss of its first batch. The checkpoint is then restored into the train
state of another mesh (targets from `train_lib.abstract_state`, as `trainer.run` builds them) and
trained from step 3: the restored state must equal the saved one exactly and the losses must equal
the reference's. Every case resumes on the TP mesh (another sharded layout); one of each kind of
state (moments, quantized moments, momentum of a matrix optimizer, Kronecker bases, low-rank factors)
also on one device (unsharded), so both targets are covered without compiling every optimizer on
three meshes.

For speed the step is jitted in two parts, the model's loss and gradients (compiled once per mesh
and shared by every optimizer) and the optimizer update, at XLA's lowest backend optimisation level;
`train_lib.make_train_step` fuses the same two parts, and `trainer.run`'s own resume path is tested in
`test_multihost_and_resharding.py` and `tests/experiments/test_train.py`.
"""

import functools

import jax
import numpy as np
import optax
import pytest

from experiments import checkpointing, run_spec, train_lib
from experiments.configs import default
from lm import model as model_lib
from lm.loss import cross_entropy
from optim import registry

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SAVE_MESH = {"mesh": "fsdp:8"}
RESUME_MESHES = {"one_device": {"mesh": "data:1", "devices": 1}, "tp": {"mesh": "data:2,tensor:4", "rules": "tp"}}
# Shampoo's roots and SOAP's bases are recomputed after the resume too (from restored statistics).
FAST_REFRESH = {"precondition_every": 2, "precondition_frequency": 2}
# Optimizers built for replicas keep per-replica state that resumes on the same replica count only
# (tests/experiments/test_replica_local.py).
VARIANTS = [(name, {}) for name in sorted({n for n, c in registry.OPTIMIZERS.items() if not c.replica_local})] + [("adamw", {"state_bits": 8}), ("adamw", {"cautious": True})]
ALSO_ON_ONE_DEVICE = [("adamw", {}), ("adamw", {"state_bits": 8}), ("muon", {}), ("soap", {}), ("dion", {})]
SAVED_AT, STEPS = 2, 5


def _config(name, common_keys, placement):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = STEPS, 8, 16
    config.model.update({"d_model": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "mlp_dim": 64})
    config.optimizer.name, config.optimizer.warmup_steps = name, 1
    family = config.optimizer[name]
    family.update({k: v for k, v in FAST_REFRESH.items() if k in family})
    config.optimizer.update(common_keys)
    config.update(placement)
    return config


@functools.cache
def _loss_and_grads(mesh_key, cfg):
    """jit of ``(params, tokens) -> ((loss, aux), grads)`` for the model ``cfg`` on one placement."""
    spec = run_spec.build_run(_config("adamw", {}, dict(mesh_key)))
    model_def = model_lib.define(cfg)

    def loss_fn(params, tokens):
        logits, aux = model_lib.apply(model_def, params, tokens[:, :-1], return_aux=True)
        return cross_entropy(logits, tokens[:, 1:])[0], aux

    shardings = spec.shardings
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    return jax.jit(
        grad_fn,
        in_shardings=(shardings.params, shardings.batch),
        out_shardings=(None, shardings.params),
        compiler_options=FAST_COMPILE,
    )


_INITIAL_PARAMS = {}  # placement -> parameters at step 0, the same for every optimizer


class Trainer:
    """The train state of one optimizer on one placement, stepped on fixed batches."""

    def __init__(self, name, common_keys, placement):
        self.spec = run_spec.build_run(_config(name, common_keys, placement))
        shardings, tx = self.spec.shardings, optax.with_extra_args_support(self.spec.tx)
        self.placement = tuple(sorted(placement.items()))
        self.grads = _loss_and_grads(self.placement, self.spec.cfg)

        def apply(params, opt_state, grads, aux):
            updates, opt_state = tx.update(grads, opt_state, params, **aux)
            return optax.apply_updates(params, updates), opt_state

        in_out = (shardings.params, shardings.state["opt_state"])
        self.update = jax.jit(apply, in_shardings=(*in_out, shardings.params, None), out_shardings=in_out, compiler_options=FAST_COMPILE)

    def init_state(self):
        """`train_lib.init_state` with the parameters shared by every optimizer."""
        shardings, counters = self.spec.shardings, ("step", "bad_streak", "skipped")
        with jax.set_mesh(self.spec.mesh):
            if self.placement not in _INITIAL_PARAMS:
                _INITIAL_PARAMS[self.placement] = model_lib.init_params(self.spec.model_def, 0, shardings.params)
            params = _INITIAL_PARAMS[self.placement]
            opt_state = jax.jit(self.spec.tx.init, out_shardings=shardings.state["opt_state"], compiler_options=FAST_COMPILE)(params)
            return {"params": params, "opt_state": opt_state, **{k: jax.device_put(np.int32(0), shardings.state[k]) for k in counters}}

    def abstract_state(self):
        return train_lib.abstract_state(self.spec.model_def, self.spec.tx, self.spec.shardings)

    def loss(self, state, tokens):
        with jax.set_mesh(self.spec.mesh):
            (loss, _), _ = self.grads(state["params"], train_lib.global_batch(tokens, self.spec.shardings))
        return float(loss)

    def train(self, state, batches):
        """Steps ``state`` once per batch; returns the new state and the loss of each step."""
        losses = []
        with jax.set_mesh(self.spec.mesh):
            for tokens in batches:
                (loss, aux), grads = self.grads(state["params"], train_lib.global_batch(tokens, self.spec.shardings))
                params, opt_state = self.update(state["params"], state["opt_state"], grads, aux)
                state = {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1}
                losses.append(float(loss))
        return state, losses


@pytest.mark.devices(8)
@pytest.mark.parametrize("name, keys", VARIANTS, ids=[n + "".join(f"-{k}={v}" for k, v in kw.items()) for n, kw in VARIANTS])
def test_checkpoint_saved_on_fsdp_resumes_on_other_meshes_like_an_uninterrupted_run(tmp_path, name, keys):
    batches = np.random.default_rng(0).integers(0, 256, (STEPS, 8, 17))
    meta = {"optimizer": name, **keys}
    saver = Trainer(name, keys, SAVE_MESH)
    state, reference = saver.train(saver.init_state(), batches[:SAVED_AT])
    mgr = checkpointing.manager(tmp_path, keep=1, every=1)
    checkpointing.save(mgr, SAVED_AT, state, {}, meta, force=True)
    mgr.wait_until_finished()
    saved = jax.device_get(state)
    final, rest = saver.train(state, batches[SAVED_AT:])
    reference += rest
    assert np.isfinite(reference).all() and saver.loss(final, batches[0]) < reference[0]  # it learned

    targets = ("tp", "one_device") if (name, keys) in ALSO_ON_ONE_DEVICE else ("tp",)
    for target in targets:
        trainer = Trainer(name, keys, RESUME_MESHES[target])
        with jax.set_mesh(trainer.spec.mesh):
            step, restored, _ = checkpointing.restore(mgr, trainer.abstract_state(), meta)
        assert step == SAVED_AT
        assert {leaf.sharding.mesh.shape_tuple for leaf in jax.tree.leaves(restored)} == {trainer.spec.mesh.shape_tuple}
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), saved)
        _, resumed = trainer.train(restored, batches[SAVED_AT:])
        assert resumed == pytest.approx(reference[SAVED_AT:], rel=1e-5), target
    mgr.close()
