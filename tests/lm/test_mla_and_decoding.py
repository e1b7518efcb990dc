"""Multi-head latent attention and KV-cache decoding: both equal the full forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lm import config as config_lib
from lm import kv_cache, sampling
from lm import model as model_lib
from lm.mla import MultiHeadLatentAttention
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib
from sharding.rules import LOGICAL_AXES

SEQ = 10
CONFIGS = {
    "gqa": {},
    "mla_q_lora_v_dim": {"attention_type": "mla", "q_lora_rank": 48, "v_head_dim": 24},
    "mla_unrolled": {"attention_type": "mla", "scan_layers": False},
    # capacity 1 slot an expert per 2 tokens: the full forward drops slots, decoding is dropless
    "moe_capacity": {"n_experts": 4, "experts_per_token": 2, "capacity_factor": 0.5},
}


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.P))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def _tiny(**overrides):
    return config_lib.from_preset("tiny", **{"n_layers": 2, "attention": "xla", **overrides})


def _gaussian(tree, seed):
    """Gaussian arrays shaped like ``tree``'s leaves (matrices scaled by 1/sqrt(fan_in)), drawn by NumPy."""
    rng = np.random.default_rng(seed)
    scale = lambda x: 1.0 if x.ndim < 2 else x.shape[-2] ** -0.5
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * scale(x)), tree)


def random_params(model_def, seed):
    """Random parameters without compiling the model's initialiser (seconds per model on a busy CPU)."""
    return _gaussian(model_def.abstract_params, seed)


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    cfg = _tiny(**CONFIGS[request.param])
    model_def = model_lib.define(cfg)
    params = random_params(model_def, seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, SEQ)), jnp.int32)
    dropless_def = model_lib.define(dataclasses.replace(cfg, capacity_factor=0.0))  # what decoding computes
    full = jax.jit(lambda p, t: model_lib.apply(dropless_def, p, t))(params, tokens)
    decode = jax.jit(lambda p, t, c, s: model_lib.decode(model_def, p, t, c, s))
    return cfg, params, tokens, full, decode


def test_mla_parameters_are_named_and_counted():
    cfg = _tiny(attention_type="mla", q_lora_rank=48, v_head_dim=24)
    model_def = model_lib.define(cfg)
    shapes = {k: v.shape for k, v in _flat(model_def.abstract_params).items() if "/attn/" in k}
    specs = {k: tuple(v) for k, v in _flat(model_def.logical_specs).items() if "/attn/" in k}
    h, nope, rope, r, vd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank, 24
    assert shapes == {
        "blocks/attn/q_down/kernel": (2, 128, 48),
        "blocks/attn/q_norm/scale": (2, 48),
        "blocks/attn/q_up/kernel": (2, 48, h * (nope + rope)),
        "blocks/attn/kv_down/kernel": (2, 128, r),
        "blocks/attn/kv_norm/scale": (2, r),
        "blocks/attn/k_rope_proj/kernel": (2, 128, rope),
        "blocks/attn/k_up/kernel": (2, r, h * nope),
        "blocks/attn/v_up/kernel": (2, r, h * vd),
        "blocks/attn/o_proj/kernel": (2, h * vd, 128),
    }
    assert specs["blocks/attn/kv_down/kernel"] == ("layers", "embed", "latent")
    assert specs["blocks/attn/k_up/kernel"] == ("layers", "latent", "heads")
    assert all(set(s) <= set(LOGICAL_AXES) for s in _flat(model_def.logical_specs).values())
    assert sum(int(np.prod(p.shape)) for p in _flat(model_def.abstract_params).values()) == model_lib.param_counts(cfg).total


def test_mla_rejects_bad_settings_with_the_fix():
    with pytest.raises(ValueError, match="rope_head_dim=3 must be even"):
        _tiny(attention_type="mla", rope_head_dim=3)
    with pytest.raises(ValueError, match="qk_norm applies to gqa only"):
        _tiny(attention_type="mla", qk_norm=True)
    with pytest.raises(ValueError, match="attention_type='mqa' must be one of gqa, mla"):
        _tiny(attention_type="mqa")
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        kv_cache.init(_tiny(), 1, 2048)


def test_prefill_and_step_by_step_decode_equal_the_full_forward_at_every_position(model):
    cfg, params, tokens, full, decode = model
    prefill = 3
    logits, cache = decode(params, tokens[:, :prefill], kv_cache.init(cfg, 2, SEQ), 0)
    assert jax.tree.map(jnp.shape, cache) == kv_cache.shapes(cfg, 2, SEQ)
    np.testing.assert_allclose(logits, full[:, :prefill], atol=1e-4, rtol=1e-4)
    steps = [logits]
    for t in range(prefill, SEQ):
        logits, cache = decode(params, tokens[:, t : t + 1], cache, jnp.int32(t))
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-4, rtol=1e-4)
    if cfg.capacity_factor > 0:  # a sample's logits do not depend on the rest of its batch (were: its slots competed)
        alone, _ = decode(params, tokens[:1, :prefill], kv_cache.init(cfg, 1, SEQ), 0)
        np.testing.assert_allclose(alone, full[:1, :prefill], atol=1e-4, rtol=1e-4)
        capped = model_lib.apply(model_lib.define(cfg), params, tokens)  # the training forward drops slots here
        assert not np.allclose(capped, full, atol=1e-2)


def test_absorbed_mla_decode_equals_materialised_attention():
    """One MLA layer: decoding a chunk over a half-filled cache equals full attention's rows for it."""
    cfg = _tiny(attention_type="mla", q_lora_rank=40, v_head_dim=20, kv_lora_rank=24)
    with nnx.use_eager_sharding(False):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(3))))
    state = nnx.to_pure_dict(abstract)
    state = _gaussian(state, 3)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, SEQ, cfg.d_model), np.float32))
    split = 6

    @jax.jit
    def both(pure, x):
        state = jax.tree.map(lambda a: a, abstract)
        nnx.replace_by_pure_dict(state, pure)
        layer = nnx.merge(graphdef, state)
        cache = {k: v[0] for k, v in kv_cache.init(cfg, 2, SEQ + 2).items()}
        _, cache = layer.decode(x[:, :split], cache, jnp.int32(0))
        absorbed, cache = layer.decode(x[:, split:], cache, jnp.int32(split))
        return layer(x)[0], absorbed, cache

    materialised, absorbed, cache = both(state, x)
    np.testing.assert_allclose(absorbed, materialised[:, split:], atol=1e-4, rtol=1e-4)
    assert cache["latent"].shape == (2, SEQ + 2, 24) and cache["k_rope"].shape == (2, SEQ + 2, cfg.rope_head_dim)
    np.testing.assert_array_equal(cache["latent"][:, SEQ:], 0)  # rows past the written ones stay untouched


def test_mla_with_the_pallas_kernel_equals_xla():
    """The flash kernel (interpret mode here) takes MLA's value width, unequal to the query/key width."""
    cfg = _tiny(attention_type="mla", n_layers=1, v_head_dim=24)
    model_def = model_lib.define(cfg)
    params = random_params(model_def, seed=5)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 256, (1, 16)), jnp.int32)
    pallas_def = model_lib.define(dataclasses.replace(cfg, attention="pallas"))
    xla, pallas = jax.jit(lambda p, t: (model_lib.apply(model_def, p, t), model_lib.apply(pallas_def, p, t)))(params, tokens)
    np.testing.assert_allclose(pallas, xla, atol=2e-4, rtol=1e-4)


@pytest.mark.devices(8)
def test_mla_shards_under_fsdp_and_tensor_parallelism():
    cfg = _tiny(attention_type="mla", q_lora_rank=32)
    model_def = model_lib.define(cfg)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 256, (8, SEQ)), jnp.int32)
    params = random_params(model_def, seed=8)
    forward = jax.jit(lambda p, t: model_lib.apply(model_def, p, t))
    single = forward(params, tokens)
    mesh, rules = mesh_lib.make_mesh("data:2,fsdp:2,tensor:2"), rules_lib.make_rules("tp")
    shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    # The latent rank takes fsdp where embed leaves it free: up-projections split on it, down-projections on embed.
    assert shardings["blocks"]["attn"]["k_up"]["kernel"].spec == jax.P(None, "fsdp", "tensor")
    assert shardings["blocks"]["attn"]["q_up"]["kernel"].spec == jax.P(None, "fsdp", "tensor")
    assert shardings["blocks"]["attn"]["kv_down"]["kernel"].spec == jax.P(None, "fsdp", None)
    assert shardings["blocks"]["attn"]["kv_norm"]["scale"].spec == jax.P(None, "fsdp")
    with jax.set_mesh(mesh), partition.use_rules(rules):
        sharded = forward(jax.device_put(params, shardings), tokens)
    np.testing.assert_allclose(sharded, single, atol=1e-4, rtol=1e-4)


def test_cached_greedy_generation_equals_argmax_of_the_full_forward():
    """The generation loop (prefill, then a scan of one-token decodes); the caches are checked above."""
    cfg = _tiny(attention_type="mla")
    model_def = model_lib.define(cfg)
    params = random_params(model_def, seed=9)
    prompt = jnp.asarray(np.random.default_rng(10).integers(0, 256, (2, 4)), jnp.int32)
    generate = sampling.make_generate(model_def, max_new_tokens=5, temperature=0.0, valid_vocab=259)
    out = generate(params, prompt, jax.random.key(0))
    assert out.shape == (2, 9)
    np.testing.assert_array_equal(out[:, :4], prompt)
    full = jax.jit(lambda p, t: model_lib.apply(model_def, p, t))(params, out)
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(full[:, 3:-1, :259], axis=-1))


@pytest.mark.parametrize("preset", list(config_lib.PRESETS))
def test_generation_traces_for_every_preset(preset):
    """Abstractly (no allocation): the cache and the decode loop fit every preset's shapes, the speedrun's
    block stacks (value embeddings, U-net skips, windows) included."""
    model_def = model_lib.define(config_lib.from_preset(preset, dtype="bfloat16"))
    generate = sampling.make_generate(model_def, max_new_tokens=3, temperature=0.8, top_p=0.9)
    prompt = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    out = jax.eval_shape(generate, model_def.abstract_params, prompt, jax.random.key(0))
    assert out.shape == (2, 8) and out.dtype == jnp.int32
