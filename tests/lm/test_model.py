import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import config as config_lib
from lm import model as model_lib
from lm.attention import attend
from lm.layers import rotary_embedding
from lm.loss import cross_entropy, flops_per_token
from sharding.rules import LOGICAL_AXES

TINY_SHAPES = {
    "embed/embedding": ((320, 128), ("vocab", "embed")),
    "blocks/attn_norm/scale": ((4, 128), ("layers", "embed")),
    "blocks/attn/q_proj/kernel": ((4, 128, 128), ("layers", "embed", "heads")),
    "blocks/attn/k_proj/kernel": ((4, 128, 64), ("layers", "embed", "kv_heads")),
    "blocks/attn/v_proj/kernel": ((4, 128, 64), ("layers", "embed", "kv_heads")),
    "blocks/attn/o_proj/kernel": ((4, 128, 128), ("layers", "heads", "embed")),
    "blocks/mlp_norm/scale": ((4, 128), ("layers", "embed")),
    "blocks/mlp/gate_proj/kernel": ((4, 128, 384), ("layers", "embed", "mlp")),
    "blocks/mlp/up_proj/kernel": ((4, 128, 384), ("layers", "embed", "mlp")),
    "blocks/mlp/down_proj/kernel": ((4, 384, 128), ("layers", "mlp", "embed")),
    "final_norm/scale": ((128,), ("embed",)),
}


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.P))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def test_tiny_parameter_shapes_and_logical_axes():
    model_def = model_lib.define(config_lib.from_preset("tiny"))
    shapes = {k: v.shape for k, v in _flat(model_def.abstract_params).items()}
    specs = {k: tuple(v) for k, v in _flat(model_def.logical_specs).items()}
    assert shapes == {k: s for k, (s, _) in TINY_SHAPES.items()}
    assert specs == {k: names for k, (_, names) in TINY_SHAPES.items()}
    assert all(v.dtype == jnp.float32 for v in _flat(model_def.abstract_params).values())


@pytest.mark.parametrize("preset", list(config_lib.PRESETS))
def test_every_preset_is_fully_annotated_and_counted(preset):
    cfg = config_lib.from_preset(preset, tie_embeddings=False, qk_norm=True)
    model_def = model_lib.define(cfg)
    params, specs = _flat(model_def.abstract_params), _flat(model_def.logical_specs)
    assert params.keys() == specs.keys()
    for name, leaf in params.items():
        assert len(specs[name]) == leaf.ndim, name
        assert set(specs[name]) <= set(LOGICAL_AXES), (name, specs[name])
    assert sum(int(np.prod(p.shape)) for p in params.values()) == cfg.num_params()


def test_preset_sizes():
    assert 0.7e6 < config_lib.from_preset("tiny").num_params() < 1.3e6
    assert 17e6 < config_lib.from_preset("small").num_params() < 23e6
    assert 110e6 < config_lib.from_preset("gpt2-124m").num_params() < 135e6
    assert 1.1e9 < config_lib.from_preset("llama-1b").num_params() < 1.35e9


@pytest.mark.parametrize("preset", ["gpt2-124m", "llama-1b"])
def test_large_presets_compile_abstractly(preset):
    model_def = model_lib.define(config_lib.from_preset(preset, dtype="bfloat16", remat=True))
    tokens = jax.ShapeDtypeStruct((1, 128), jnp.int32)

    def loss(params, tokens):
        return cross_entropy(model_lib.apply(model_def, params, tokens[:, :-1]), tokens[:, 1:])[0]

    compiled = jax.jit(jax.grad(loss)).lower(model_def.abstract_params, tokens).compile()
    # The program takes every parameter and returns a gradient for each (1%: alignment padding).
    param_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(model_def.abstract_params))
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes == pytest.approx(param_bytes + tokens.size * 4, rel=0.01)
    assert memory.output_size_in_bytes == pytest.approx(param_bytes, rel=0.01)


def test_scan_program_size_does_not_grow_with_depth():
    def hlo_ops(n_layers):
        model_def = model_lib.define(config_lib.from_preset("tiny", n_layers=n_layers))
        tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
        text = jax.jit(lambda p, t: model_lib.apply(model_def, p, t)).lower(model_def.abstract_params, tokens).as_text()
        return text.count("\n")

    assert hlo_ops(2) == hlo_ops(12)


def _unstack(params, n_layers):
    blocks = params["blocks"]
    return {**params, "blocks": {i: jax.tree.map(lambda x: x[i], blocks) for i in range(n_layers)}}


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_and_remat_match_scan(remat):
    cfg = config_lib.from_preset("tiny", qk_norm=True)
    scan_def = model_lib.define(cfg)
    loop_def = model_lib.define(dataclasses.replace(cfg, scan_layers=False, remat=remat))
    params = model_lib.init_params(scan_def, seed=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)

    def loss(model_def, p):
        return cross_entropy(model_lib.apply(model_def, p, tokens[:, :-1]), tokens[:, 1:])[0]

    loss_scan, grads_scan = jax.jit(jax.value_and_grad(lambda p: loss(scan_def, p)))(params)
    loss_loop, grads_loop = jax.jit(jax.value_and_grad(lambda p: loss(loop_def, p)))(_unstack(params, cfg.n_layers))
    np.testing.assert_allclose(loss_scan, loss_loop, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(_unstack(grads_scan, cfg.n_layers)), jax.tree.leaves(grads_loop)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_compute_keeps_float32_params():
    cfg = config_lib.from_preset("tiny", dtype="bfloat16")
    model_def = model_lib.define(cfg)
    params = model_lib.init_params(model_def, seed=0)
    logits = jax.jit(lambda p: model_lib.apply(model_def, p, jnp.zeros((2, 8), jnp.int32)))(params)
    assert logits.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


def _naive_attention(q, k, v):
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    max_logits = np.full(h, -np.inf)
    for head in range(h):
        kh, vh = k[:, :, head // group], v[:, :, head // group]
        logits = np.einsum("bsd,btd->bst", q[:, :, head], kh) / np.sqrt(d)
        logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
        max_logits[head] = logits.max()
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[:, :, head] = np.einsum("bst,btd->bsd", w, vh)
    return out, max_logits


def test_grouped_query_attention_matches_per_head_reference():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 7, 6, 8)).astype(np.float32)
    k = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
    v = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
    out, max_logits = jax.jit(lambda *a: attend(*a, track_max_logits=True))(q, k, v)
    ref_out, ref_max = _naive_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(max_logits, ref_max, rtol=1e-5)


def test_model_reports_attention_max_logits_per_layer_and_head():
    cfg = config_lib.from_preset("tiny", track_attn_logits=True)
    model_def = model_lib.define(cfg)
    params = model_lib.init_params(model_def, seed=0)
    _, aux = jax.jit(lambda p: model_lib.apply(model_def, p, jnp.ones((2, 8), jnp.int32), return_aux=True))(params)
    assert aux["attn_max_logits"].shape == (cfg.n_layers, cfg.n_heads)
    assert np.all(np.isfinite(aux["attn_max_logits"]))
    plain_def = model_lib.define(config_lib.from_preset("tiny"))
    _, no_aux = jax.jit(lambda p: model_lib.apply(plain_def, p, jnp.ones((2, 8), jnp.int32), return_aux=True))(params)
    assert no_aux == {}


def test_rotary_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 1, 1, 16)).astype(np.float32)
    def score(m, n):
        qm = rotary_embedding(jnp.broadcast_to(q, (1, 1, 1, 16)), jnp.array([m]), 10_000.0)
        kn = rotary_embedding(jnp.broadcast_to(k, (1, 1, 1, 16)), jnp.array([n]), 10_000.0)
        return float(jnp.sum(qm * kn))
    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)
    assert score(0, 0) == pytest.approx(float(np.sum(q * k)), rel=1e-5)


def test_cross_entropy_and_z_loss_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, size=(3, 5))
    log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    nll = np.mean(log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0])
    loss, metrics = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), z_loss=1e-2)
    np.testing.assert_allclose(metrics["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(loss, nll + 1e-2 * np.mean(log_z**2), rtol=1e-5)


def test_flops_per_token_counts_matmul_parameters():
    cfg = config_lib.from_preset("tiny", tie_embeddings=False)
    model_def = model_lib.define(cfg)
    matmul_params = sum(
        int(np.prod(v.shape)) for k, v in _flat(model_def.abstract_params).items() if k.endswith("kernel")
    )
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 64
    assert flops_per_token(cfg, 64) == 6 * matmul_params + attention


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_heads=6, n_kv_heads=4), "multiple of model.n_kv_heads"),
        (dict(head_dim=31), "even"),
        (dict(dtype="float16"), "float32"),
        (dict(d_model=0), "d_model=0"),
    ],
)
def test_impossible_shapes_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_lib.from_preset("tiny", **overrides)


def test_unknown_preset_and_field_are_rejected():
    with pytest.raises(ValueError, match="one of tiny"):
        config_lib.from_preset("huge")
    with pytest.raises(ValueError, match="unknown model fields"):
        config_lib.from_preset("tiny", widht=3)
