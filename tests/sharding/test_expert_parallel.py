"""Expert parallelism: the all-to-all dispatch gives the losses of one device on expert / fsdp meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import train_lib
from lm import config as config_lib
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib

pytestmark = pytest.mark.devices(8)
STEPS = 2


@pytest.fixture(scope="module")
def runs():
    """Two SGD steps of a 1-layer, 8-expert model on each mesh: losses, and whether all-to-all ran. It routes as
    DeepSeek-V2 does (scaled gates, the best 2 of 4 expert groups): routing happens before the dispatch, on any mesh."""
    cfg = config_lib.from_preset("moe-tiny", n_layers=1, vocab_size=64, router_scale=2.0, router_groups=4, router_topk_groups=2)
    model_def = model_lib.define(cfg)
    tx = optax.sgd(0.5)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.int32)
    out = {}
    for spec in ("data:1", "expert:8", "expert:2,fsdp:4"):
        mesh = mesh_lib.make_mesh(spec, jax.devices()[:1] if spec == "data:1" else None)
        shardings = train_lib.make_shardings(model_def, tx, mesh, rules_lib.make_rules())
        with jax.set_mesh(mesh):
            state = train_lib.init_state(model_def, tx, 0, shardings)
            step = train_lib.jit_train_step(train_lib.make_train_step(model_def, tx), shardings)
            placed = jax.device_put(batch, shardings.batch)
            compiled = step.lower(state, placed).compile()
            losses = []
            for _ in range(STEPS):
                state, metrics = compiled(state, placed)
                losses.append(float(metrics["loss"]))
        out[spec] = (np.array(losses), "all-to-all" in compiled.as_text())
    return out


def test_expert_meshes_dispatch_with_all_to_all(runs):
    assert not runs["data:1"][1]
    assert runs["expert:8"][1] and runs["expert:2,fsdp:4"][1]


@pytest.mark.parametrize("spec", ["expert:8", "expert:2,fsdp:4"])
def test_expert_parallel_losses_equal_one_device(runs, spec):
    single = runs["data:1"][0]
    assert single[-1] < single[0]  # the steps train
    np.testing.assert_allclose(runs[spec][0], single, rtol=2e-5)
