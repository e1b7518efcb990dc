"""Context parallelism (`lm.context_attention`): each mode equals one device; the ring's causal work is balanced."""

import jax
import numpy as np
import pytest

from lm import config as config_lib
from lm import context_attention
from lm import loss as loss_lib
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

SEQ_LEN, BATCH = 256, 4
MESHES = [("context:4,data:2", "fsdp"), ("context:2,fsdp:2,tensor:2", "tp")]
SEPARATOR = 7


def _model(mode: str):
    """`tiny` with packed documents, reporting its attention max logits (all three are compared)."""
    # Ulysses splits each device's heads over the context shards: tiny's 2 kv heads would not split 4 ways.
    heads = {"n_kv_heads": 4} if mode == "ulysses" else {}
    cfg = config_lib.from_preset("tiny", context_parallel=mode, track_attn_logits=True, document_separator=SEPARATOR, **heads)
    return model_lib.define(cfg)


def _tokens(model_def):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_def.config.vocab_size, (BATCH, SEQ_LEN + 1), dtype=np.int32)
    tokens[:, rng.integers(1, SEQ_LEN, 12)] = SEPARATOR  # several documents per row, crossing shard boundaries
    return tokens


def _loss(params, model_def, tokens):
    logits, aux = model_lib.apply(model_def, params, tokens[:, :-1], return_aux=True)
    return loss_lib.cross_entropy(logits, tokens[:, 1:])[0], aux["attn_max_logits"]


def loss_and_grads(model_def, spec=None, rules_name="fsdp"):
    """``(loss, grads, attention max logits)`` of one batch: on one device, or on mesh ``spec`` under ``rules_name``."""
    params = model_lib.init_params(model_def, 0)
    tokens = _tokens(model_def)
    step = jax.jit(jax.value_and_grad(lambda p, t: _loss(p, model_def, t), has_aux=True))
    if spec is None:
        with jax.set_mesh(mesh_lib.make_mesh("data:1", jax.devices()[:1])):
            params = jax.device_put(params, jax.devices()[0])
            (loss, max_logits), grads = step(params, tokens)
        return loss, grads, max_logits
    mesh, rules = mesh_lib.make_mesh(spec), rules_lib.make_rules(rules_name)
    shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    with jax.set_mesh(mesh), partition.use_rules(rules):
        (loss, max_logits), grads = step(jax.device_put(params, shardings), tokens)
    return loss, grads, max_logits


def _assert_same(result, expected):
    (loss, grads, max_logits), (loss_1, grads_1, max_logits_1) = result, expected
    np.testing.assert_allclose(loss, loss_1, rtol=1e-5)
    np.testing.assert_allclose(max_logits, max_logits_1, rtol=1e-5)
    for (path, g), g_1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1), strict=True):
        error = np.linalg.norm(np.asarray(g) - np.asarray(g_1)) / np.linalg.norm(np.asarray(g_1))
        assert error < 1e-5, (jax.tree_util.keystr(path), error)


@pytest.fixture(scope="module")
def one_device():
    return {mode: loss_and_grads(_model(mode)) for mode in ("all_gather", "ulysses")}


@pytest.mark.devices(8)
@pytest.mark.parametrize("spec, rules_name", MESHES)
@pytest.mark.parametrize("mode", context_attention.MODES)
def test_mode_equals_one_device(one_device, mode, spec, rules_name):
    expected = one_device["ulysses" if mode == "ulysses" else "all_gather"]
    _assert_same(loss_and_grads(_model(mode), spec, rules_name), expected)
