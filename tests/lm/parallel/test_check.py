"""`lm.parallel.check`: one check of every parallel mode against a mesh and rules; the modes' settings are
model configuration that a resumed run may change."""

import copy

import jax
import pytest

from experiments import run_spec
from experiments.configs import default
from lm import config as config_lib
from lm.parallel import check as parallel
from sharding import rules as rules_lib


def _mesh(**axes: int) -> jax.sharding.AbstractMesh:
    return jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))


@pytest.mark.parametrize(
    "mesh, fields, batch, seq_len, replicas, message",
    [
        (dict(context=4, data=2), dict(context_parallel="ring"), 4, 100, "", "ring splits data.seq_len=100 into 8 chunks"),
        (dict(context=4, data=2), dict(context_parallel="ulysses", n_heads=6, n_kv_heads=2), 4, 64, "", "or context_parallel=ring"),
        (dict(stage=4, data=2), dict(n_layers=6), 8, 64, "", "n_layers=6 does not split into stage:4"),
        (dict(stage=4, data=2), dict(n_layers=8, pipeline_microbatches=3), 8, 64, "", r"use microbatches in \[1, 2, 4\]"),
        (dict(stage=2, data=4), dict(n_layers=8, pipeline_schedule="circular", pipeline_repeats=2, pipeline_microbatches=1), 8, 64, "",
         "needs microbatches >= stages"),
        (dict(stage=4, data=2), dict(n_layers=8), 8, 64, "data", "does not run beside a stage axis"),
        (dict(context=4, data=2), dict(context_parallel="ring"), 8, 64, "data", "does not run beside a context axis yet"),
        (dict(expert=4, data=2), dict(n_experts=4, experts_per_token=2), 8, 64, "data", "does not run beside an expert axis yet"),
        (dict(stage=2, data=4), dict(fp8="e4m3"), 8, 64, "", "delayed FP8 scaling under a pipeline .* set model.fp8_scaling=current"),
        (dict(stage=2, data=4), dict(parscale=2), 8, 64, "", "parscale > 1 runs on meshes without a `stage` or `context` axis"),
        (dict(context=2, data=4), dict(parscale=2, context_parallel="ring"), 8, 64, "", "parscale > 1 runs on meshes without"),
        (dict(context=2, data=4), dict(attention_type="lightning", scan_layers=False), 8, 64, "", "lightning does not run with the sequence split"),
    ],
)  # fmt: skip
def test_each_mode_refuses_a_layout_it_cannot_run_in_one_line(mesh, fields, batch, seq_len, replicas, message):
    cfg = config_lib.from_preset("tiny", **fields)
    rules = rules_lib.make_rules("fsdp")
    with pytest.raises(ValueError, match=message) as error:
        parallel.check(cfg, _mesh(**mesh), rules, batch=batch, seq_len=seq_len, replicas=replicas)
    assert "\n" not in str(error.value)


def test_a_layout_every_mode_can_run_passes():
    cfg = config_lib.from_preset("tiny", n_layers=8, context_parallel="ulysses", pipeline_schedule="1f1b", pipeline_microbatches=4)
    parallel.check(cfg, _mesh(context=2, stage=2, data=2), rules_lib.make_rules("fsdp"), batch=8, seq_len=64)


def test_parallel_settings_do_not_change_what_a_resumed_checkpoint_must_match():
    config = default.get_config()
    meta = run_spec.run_meta(config, run_spec.model_config(config))
    changes = {"context_parallel": "ring", "pipeline_schedule": "1f1b", "pipeline_microbatches": 8, "pipeline_repeats": 2}
    for key, value in changes.items():
        changed = copy.deepcopy(config)
        changed.model[key] = value
        assert run_spec.run_meta(changed, run_spec.model_config(changed)) == meta, key
    changed.model.n_layers = 8  # an architecture field does change it
    assert run_spec.run_meta(changed, run_spec.model_config(changed)) != meta
