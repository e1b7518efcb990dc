import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import config as config_lib
from lm import model as model_lib
from lm import remat as remat_lib
from lm import transformer
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
    gqa = config_lib.PRESETS[preset].get("attention_type", "gqa") == "gqa"
    cfg = config_lib.from_preset(preset, tie_embeddings=False, qk_norm=gqa)  # MLA normalises its latents instead
    model_def = model_lib.define(cfg)
    params, specs = _flat(model_def.abstract_params), _flat(model_def.logical_specs)
    assert params.keys() == specs.keys()
    for name, leaf in params.items():
        assert len(specs[name]) == leaf.ndim, name
        assert set(specs[name]) - {None} <= set(LOGICAL_AXES), (name, specs[name])  # None: replicated (learned scalars)
    assert sum(int(np.prod(p.shape)) for p in params.values()) == model_lib.count_params(model_def).total


def test_preset_sizes():
    assert 0.7e6 < model_lib.param_counts(config_lib.from_preset("tiny")).total < 1.3e6
    assert 17e6 < model_lib.param_counts(config_lib.from_preset("small")).total < 23e6
    assert 110e6 < model_lib.param_counts(config_lib.from_preset("gpt2-124m")).total < 135e6
    assert 1.1e9 < model_lib.param_counts(config_lib.from_preset("llama-1b")).total < 1.35e9


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
        model_def = model_lib.define(config_lib.from_preset("tiny", n_layers=n_layers, scan_unroll=1))
        tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
        text = jax.jit(lambda p, t: model_lib.apply(model_def, p, t)).lower(model_def.abstract_params, tokens).as_text()
        return text.count("\n")

    assert hlo_ops(2) == hlo_ops(12)


def _loss_and_grads(cfg, params, tokens):
    model_def = model_lib.define(cfg)

    def loss(p):
        return cross_entropy(model_lib.apply(model_def, p, tokens[:, :-1]), tokens[:, 1:])[0]

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def scanned_reference():
    """A 2-layer model with every block feature on, scanned one block per iteration without remat:
    config, params, tokens, loss, grads."""
    cfg = config_lib.from_preset("tiny", n_layers=2, qk_norm=True, scan_unroll=1)
    params = model_lib.init_params(model_lib.define(cfg), seed=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size)
    return cfg, params, tokens, *_loss_and_grads(cfg, params, tokens)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(scan_unroll=2),  # every block in one iteration: the straight-line body XLA:CPU's auto unroll runs
        dict(remat="full"),
        dict(remat="dots_with_no_batch_dims_saveable", scan_unroll=2),
        dict(remat="dots_and_attention"),
        dict(scan_layers=False),
        dict(scan_layers=False, remat="full"),
        dict(scan_layers=False, remat="save_attention"),
    ],
)
def test_unrolled_layers_unroll_and_remat_policies_match_scan(scanned_reference, overrides):
    cfg, params, tokens, ref_loss, ref_grads = scanned_reference
    cfg = dataclasses.replace(cfg, **overrides)
    if not cfg.scan_layers:
        params = {**params, "blocks": model_lib.unstack_layers(params["blocks"], cfg.n_layers)}
        ref_grads = {**ref_grads, "blocks": model_lib.unstack_layers(ref_grads["blocks"], cfg.n_layers)}
    loss, grads = _loss_and_grads(cfg, params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("optimised", [True, False], ids=["xla_optimises", "most_optimisations_off"])
def test_auto_unroll_runs_every_block_at_once_on_the_cpu_unless_remat_is_on(optimised):
    """issue 33: ``scan_unroll=0`` (the default) unrolls the whole scan on XLA:CPU, whose rolled scan
    writes zero-filled residual stacks; under remat the scan stays rolled (unrolled, XLA:CPU keeps
    what remat should free), and where XLA skips most optimisations (compile time first); an explicit
    value is kept, capped at the number of blocks."""
    cfg = config_lib.from_preset("tiny")
    assert cfg.scan_unroll == 0
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not optimised)
    try:
        unrolled = transformer.layers_per_iteration(cfg, 4)
        with_remat = transformer.layers_per_iteration(dataclasses.replace(cfg, remat="full"), 4)
        explicit = [transformer.layers_per_iteration(dataclasses.replace(cfg, scan_unroll=n), 4) for n in (2, 8)]
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
    assert unrolled == (4 if jax.default_backend() == "cpu" and optimised else 1)
    assert with_remat == 1
    assert explicit == [2, 4]


@pytest.mark.xla_optimized  # bit-exact across two programs: the result of XLA's optimised numerics
def test_unrolled_model_initialises_like_the_scanned_one():
    cfg = config_lib.from_preset("tiny", n_layers=3, tie_embeddings=False)
    scanned = model_lib.init_params(model_lib.define(cfg), seed=4)
    unrolled_def = model_lib.define(dataclasses.replace(cfg, scan_layers=False))
    unrolled = model_lib.init_params(unrolled_def, seed=4)
    expected = {**scanned, "blocks": model_lib.unstack_layers(scanned["blocks"], cfg.n_layers)}
    assert jax.tree.structure(unrolled) == jax.tree.structure(unrolled_def.abstract_params)
    for a, b in zip(jax.tree.leaves(unrolled), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(unrolled["blocks"][0]["attn"]["q_proj"]["kernel"], unrolled["blocks"][1]["attn"]["q_proj"]["kernel"])


def _dot_products(jaxpr) -> int:
    """Matrix products in ``jaxpr`` and every jaxpr nested in it (remat, scan, pjit bodies)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    count += _dot_products(getattr(sub, "jaxpr", sub))
    return count


# Products each policy runs again in the backward pass of one block (XLA attention). A block has 9:
# q, k, v, o projections, attention's scores and values, gate, up, down. `full` reruns all but
# `down`, whose output no gradient reads; `dots_with_no_batch_dims_saveable` reruns attention's two;
# `save_attention` keeps q, k, v, the context and the softmax's log-sum-exp (`reference.RESIDUAL_NAME`)
# but reruns o (the MLP norm's input needs it), gate and up; `dots_and_attention` reruns nothing.
# (Attention's backward pass recomputes the scores from the log-sum-exp under every policy.)
RECOMPUTED_PER_BLOCK = {
    "none": 0,
    "full": 8,
    "dots_saveable": 0,
    "dots_with_no_batch_dims_saveable": 2,
    "save_attention": 3,
    "dots_and_attention": 0,
}


@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_policies_recompute_what_they_name(scan_layers):
    assert set(RECOMPUTED_PER_BLOCK) == set(remat_lib.NAMES)
    tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    n_layers = 3
    counts = {}
    for policy in remat_lib.NAMES:
        model_def = model_lib.define(config_lib.from_preset("tiny", n_layers=n_layers, scan_layers=scan_layers, remat=policy))
        loss = lambda p, t: cross_entropy(model_lib.apply(model_def, p, t[:, :-1]), t[:, 1:])[0]  # noqa: E731
        counts[policy] = _dot_products(jax.make_jaxpr(jax.grad(loss))(model_def.abstract_params, tokens).jaxpr)
    blocks_in_program = 1 if scan_layers else n_layers  # a scan body appears once
    assert {p: (c - counts["none"]) / blocks_in_program for p, c in counts.items()} == RECOMPUTED_PER_BLOCK


def test_save_attention_keeps_fused_attention_kernel_outputs():
    """cuDNN's and Pallas' attention forward outputs (context, softmax statistics) are saved, nothing else unnamed."""
    policy = remat_lib.POLICIES["save_attention"]
    prim = lambda name: jax.extend.core.Primitive(name)  # noqa: E731
    assert policy(prim("dot_product_attention_fwd_wrapper")) and policy(prim("pallas_call"))
    assert not policy(prim("exp")) and not policy(prim("dot_general"))
    assert policy(prim("name"), name="attn_context") and not policy(prim("name"), name="mlp_hidden")


@pytest.mark.parametrize("value, name", [(True, "full"), (False, "none"), ("true", "full"), ("False", "none"), ("save_attention", "save_attention")])
def test_remat_accepts_booleans_as_aliases(value, name):
    assert config_lib.from_preset("tiny", remat=value).remat == name


def test_bfloat16_compute_keeps_float32_params():
    cfg = config_lib.from_preset("tiny", dtype="bfloat16")
    model_def = model_lib.define(cfg)
    params = model_lib.init_params(model_def, seed=0)
    logits = jax.jit(lambda p: model_lib.apply(model_def, p, jnp.zeros((2, 8), jnp.int32)))(params)
    assert logits.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))


def test_embedding_gradient_adds_repeated_tokens_in_float32():
    """A token's table gradient is the float32 sum of its occurrences' bf16 gradients (as PyTorch's float32
    embedding under autocast), in the token table and the value tables: nnx.Embed summed them in bf16, here up to
    9.9 off for a token seen about 1,365 times."""
    from flax import nnx

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 3, 4096))
    for preset, tables in (("tiny", lambda m: [m.embed]), ("speedrun-tiny", lambda m: [m.embed, *m.value_embeds])):
        with nnx.use_eager_sharding(False):
            model = transformer.Transformer(config_lib.from_preset(preset, dtype="bfloat16"), rngs=nnx.Rngs(0))
        for table in tables(model):
            dy = np.random.default_rng(1).normal(size=(4096, table.features)).astype(jnp.bfloat16)
            grad = nnx.grad(lambda t, dy=dy: jnp.sum(t(ids).astype(jnp.float32) * dy.astype(np.float32)))(table).embedding[...]
            want = np.zeros(grad.shape)
            np.add.at(want, np.asarray(ids), dy.astype(np.float64))
            np.testing.assert_allclose(grad, want, atol=1e-4, rtol=1e-5)


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
        (dict(remat="dots"), "model.remat='dots' must be one of none, full"),
        (dict(scan_unroll=-1), "scan_unroll=-1 must be >= 1, or 0 for auto"),
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
