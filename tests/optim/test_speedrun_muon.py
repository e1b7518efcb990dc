"""The speedrun's optimizer groups (optim/speedrun_muon.py) against a NumPy transcription of record 21's
``optimizer1`` (three Adam groups) and ``optimizer2`` (Muon, momentum warmed up), both under one schedule."""

import jax
import muon_reference as ref
import numpy as np
import optax

from experiments.configs import speedrun as speedrun_config
from lm import config as config_lib
from lm import model as model_lib
from optim import build
from optim.speedrun_muon import SpeedrunMuon, group_labels, momentum_warmup
from optim.speedrun_muon import speedrun_muon as make


def _record_beta(step, warmup=300):
    """``train_gpt.py``: ``frac = min(step / 300, 1); momentum = (1 - frac) * 0.85 + frac * 0.95``."""
    frac = min(step / warmup, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def test_defaults_are_the_records_rates_and_momentum_warmup():
    s = SpeedrunMuon()
    assert (s.learning_rate, s.beta, s.shape_scale, s.nesterov, s.weight_decay) == (0.05, 0.95, "jordan", True, 0.0)
    np.testing.assert_allclose([s.learning_rate * r for r in (s.embed_lr_ratio, s.head_lr_ratio, s.adam_lr_ratio)], [0.6, 0.008, 0.04])
    assert (s.adam_b1, s.adam_b2, s.adam_eps) == (0.8, 0.95, 1e-10)
    schedule = momentum_warmup(s.momentum_warmup_start, s.beta, s.momentum_warmup_steps)
    for step in (0, 1, 150, 299, 300, 1769):
        np.testing.assert_allclose(float(schedule(step)), _record_beta(step), rtol=1e-6)


def _tree():
    tree = ref.model_tree(1, untied=True, scale=0.1)
    rng = np.random.default_rng(2)
    tree["value_embeds"] = {"0": {"embedding": 0.1 * rng.standard_normal((11, 8))}}
    tree["skip_weights"] = rng.standard_normal(1)
    tree["blocks"]["x0_lambdas"] = rng.standard_normal((2, 2))[:, 0]  # a (layers,) stack of one scalar
    return ref.f32(tree)


def test_each_group_steps_at_its_rate_and_muon_at_the_warmed_up_momentum():
    params, lr, ratios, warmup = _tree(), optax.linear_schedule(0.05, 0.02, 4), {"embed": 12.0, "head": 0.16, "adam": 0.8}, 3
    grads_seq = ref.grads_sequence(params, n=5)
    tx = make(lr, embed_lr_ratio=ratios["embed"], head_lr_ratio=ratios["head"], momentum_warmup_steps=warmup, ns_batching="same_shape")
    got = ref.run_jax(tx, params, grads_seq)

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    values, adam, mus = [leaf for _, leaf in flat], ref.AdamW(0.8, 0.95, 1e-10), {}
    for t, grads in enumerate(grads_seq):
        new = []
        for i, ((path, _), p, g) in enumerate(zip(flat, values, jax.tree.leaves(grads), strict=True)):
            names = [str(getattr(k, "key", k)) for k in path]
            if ref.is_matrix(path, p):
                d, mus[i] = ref.momentum(g, mus.get(i, 0.0), _record_beta(t, warmup), "ema", nesterov=True)
                new.append(p - float(lr(t)) * ref.shape_scale(p.shape, "jordan") * ref.orthogonalize(d))
            else:
                group = "head" if "lm_head" in names else "embed" if "embedding" in names else "adam"
                new.append(p + adam.update(i, g, p, ratios[group] * float(lr(t)), 0.0))
        values = new
        ref.assert_trees_close(got[t], treedef.unflatten(values))


def test_a_tied_table_is_the_head_and_value_tables_stay_embeddings():
    """Without an LM head the token table reads out (tied embeddings): it takes the head's rate, not the 12x that
    diverged (tests/sharding/test_checkpoint_any_mesh.py trains the tied micro LM at the defaults)."""
    tied = {k: v for k, v in _tree().items() if k != "lm_head"}
    assert group_labels(tied)["embed"]["embedding"] == "head"
    assert group_labels(tied)["value_embeds"]["0"]["embedding"] == "embed"
    assert group_labels(_tree())["embed"]["embedding"] == "embed"  # untied, as the record


def test_the_speedrun_config_builds_it_over_the_records_groups():
    config = speedrun_config.get_config("tiny")
    assert config.optimizer.name == "speedrun_muon"
    model_def = model_lib.define(config_lib.from_preset(config.model.preset))
    by_group = {}
    for path, label in jax.tree_util.tree_leaves_with_path(group_labels(model_def.abstract_params)):
        by_group.setdefault(label, set()).add("/".join(str(getattr(k, "key", k)) for k in path if not hasattr(k, "idx")))
    assert {p.split("/")[0] for p in by_group["embed"]} == {"embed", "value_embeds"}
    assert by_group["head"] == {"lm_head/kernel"}
    assert {p.rsplit("/", 1)[-1] for p in by_group["adam"]} == {"skip_weights", "x0_lambdas", "v_lambdas"}
    assert all(p.startswith("blocks/") for p in by_group["matrix"])
    record = speedrun_config.get_config()
    spec = build.make_spec(record.optimizer.to_dict(), record.steps)
    assert isinstance(spec, SpeedrunMuon) and spec == SpeedrunMuon(learning_rate=spec.learning_rate)  # the record's defaults
    for step in (0, 1062, 1416, 1769):  # train_gpt.py's get_lr: stable, then linear to 0.1x over the last 40%
        w = min((1 - step / 1770) / 0.4, 1.0)
        np.testing.assert_allclose(float(spec.learning_rate(step)), 0.05 * (w + (1 - w) * 0.1), rtol=1e-6)
