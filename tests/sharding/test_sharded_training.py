"""One config, any mesh: the same losses on 1 device and on 8 under every parallelism."""

import functools

import jax
import numpy as np
import optax
import pytest

from experiments import run_spec, train_lib
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib
from lm.data import corpus
from optim import blocking
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

pytestmark = pytest.mark.devices(8)  # 10-step runs compile more than they run: 157 CPU-s here, 243 with XLA's passes

MESHES = [
    ("data:8", "fsdp"),
    ("fsdp:8", "fsdp"),
    ("tensor:2,fsdp:4", "tp"),
    ("data:2,fsdp:2,tensor:2", "tp"),
    ("data:2,seq:4", "sp"),
]


def _text_batches(steps, batch, seq_len):
    """Consecutive windows of the stdlib corpus's validation split (real text, fixed)."""
    stream = corpus.load("")["validation"]
    return np.asarray(stream[: steps * batch * (seq_len + 1)], np.int32).reshape(steps, batch, seq_len + 1)


def train_losses(preset, spec, rules_name, *, steps, devices=None, seq_len=32, batch=8, lr=3e-3, **overrides):
    model_def = model_lib.define(config_lib.from_preset(preset, **overrides))
    tx = optax.adamw(lr, b2=0.95, weight_decay=0.1)
    mesh = mesh_lib.make_mesh(spec, devices)
    rules = rules_lib.make_rules(rules_name)
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules)
    batches = _text_batches(steps, batch, seq_len)
    losses = []
    with jax.set_mesh(mesh), partition.use_rules(rules):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        step = train_lib.jit_train_step(train_lib.make_train_step(model_def, tx), shardings)
        for tokens in batches:
            state, metrics = step(state, train_lib.global_batch(tokens.astype(np.int32), shardings))
            losses.append(float(metrics["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def single_device_tiny():
    return train_losses("tiny", "data:1", "fsdp", steps=10, devices=jax.devices()[:1])[0]


@pytest.fixture(scope="module")
def tiny_run():
    """``(losses, final state)`` of `tiny`'s 10-step run on a mesh, once per mesh for the module's tests."""
    return functools.cache(lambda spec, rules_name: train_losses("tiny", spec, rules_name, steps=10))


@pytest.mark.parametrize("spec, rules_name", MESHES)
def test_tiny_losses_match_single_device(single_device_tiny, tiny_run, spec, rules_name):
    losses, _ = tiny_run(spec, rules_name)
    np.testing.assert_allclose(losses, single_device_tiny, rtol=1e-5)
    assert losses[-1] < losses[0] - 1.0  # it trained


# `small`'s widths, heads and grouped KV at 2 of its 8 layers: the scanned stack shards the same at any depth, and
# its steps' execution (most of this test's time at XLA's lowest level) falls with the depth.
SMALL_DEPTH = {"n_layers": 2}


@pytest.fixture(scope="module")
def single_device_small():
    return train_losses("small", "data:1", "fsdp", steps=3, devices=jax.devices()[:1], seq_len=16, lr=3e-4, **SMALL_DEPTH)[0]


def test_small_losses_match_single_device(single_device_small):
    """`small` (cut to `SMALL_DEPTH`) on the mesh that uses all three of data, FSDP and tensor parallelism (each
    on its own is checked on `tiny` above).

    At lr 3e-3, Adam's first steps turn fp32 reduction-order noise in near-zero gradient entries
    into full-size updates of either sign, and the full 20M model drifts ~1e-4 apart however it is
    sharded; at 3e-4 that drift stays inside the 1e-5 the sharding must meet."""
    losses, _ = train_losses("small", "data:2,fsdp:2,tensor:2", "tp", steps=3, seq_len=16, lr=3e-4, **SMALL_DEPTH)
    np.testing.assert_allclose(losses, single_device_small, rtol=1e-5)


def _total_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_fsdp_holds_an_eighth_of_params_and_optimizer_state_per_device(tiny_run):
    _, state = tiny_run("fsdp:8", "fsdp")  # after training: the step keeps the layout
    assert partition.per_device_bytes(state["params"]) * 8 == _total_bytes(state["params"])
    moments = [leaf for leaf in jax.tree.leaves(state["opt_state"]) if leaf.ndim > 0]
    assert partition.per_device_bytes(moments) * 8 == _total_bytes(moments)
    for leaf in moments:
        assert len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated


def test_tensor_parallel_splits_heads_and_mlp(tiny_run):
    _, state = tiny_run("tensor:2,fsdp:4", "tp")
    blocks = state["params"]["blocks"]
    assert blocks["attn"]["q_proj"]["kernel"].sharding.spec == jax.P(None, "fsdp", "tensor")
    assert blocks["mlp"]["down_proj"]["kernel"].sharding.spec == jax.P(None, "tensor", "fsdp")


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_block_statistics_are_spread_over_devices_in_training(name):
    config = default.get_config()
    config.mesh = "fsdp:8"
    config.optimizer.name = name
    spec = run_spec.build_run(config)
    with jax.set_mesh(spec.mesh):
        state = train_lib.init_state(spec.model_def, spec.tx, 0, spec.shardings)
    is_stack = lambda x: isinstance(x, blocking.BlockStacks)  # noqa: E731
    nodes = [n for n in jax.tree.leaves(state["opt_state"], is_leaf=is_stack) if is_stack(n)]
    stacks = [leaf for node in nodes for leaf in jax.tree.leaves(dict(node))]
    assert stacks, "no stacked blocks found"
    for leaf in stacks:
        assert partition.per_device_bytes([leaf]) * 8 == leaf.size * leaf.dtype.itemsize
