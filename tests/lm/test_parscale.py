"""ParScale (`lm.parscale`): the authors' forward pass, P = 1 as the plain model, decoding, GSPMD, counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import config as config_lib
from lm import hf, kv_cache, sampling
from lm import loss as loss_lib
from lm import model as model_lib
from optim import labels
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib
from tests.lm import parscale_reference

SEQ, VOCAB, P, BATCH = 8, 64, 3, 4
SMALL = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "mlp_dim": 64, "max_seq_len": 32, "attention": "xla"}


def _config(**overrides) -> config_lib.ModelConfig:
    return config_lib.from_preset("tiny", **{**SMALL, **overrides})


def _gaussian(tree, seed):
    """NumPy-drawn Gaussian leaves (matrices scaled by 1/sqrt(fan_in)); biases nonzero, unlike the initialiser's."""
    rng = np.random.default_rng(seed)
    scale = lambda x: 1.0 if x.ndim < 2 else x.shape[-2] ** -0.5
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * scale(x)), tree)


@pytest.fixture(scope="module")
def model():
    cfg = _config(parscale=P, parscale_prefix_tokens=4, parscale_smoothing=0.1)
    model_def = model_lib.define(cfg)
    params = _gaussian(model_def.abstract_params, seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    forward = jax.jit(lambda p, t: model_lib.apply(model_def, p, t))
    return model_def, params, tokens, forward, forward(params, tokens)


def test_matches_the_authors_forward(model):
    model_def, params, tokens, _, logits = model
    want = parscale_reference.forward(jax.tree.map(lambda x: np.asarray(x, np.float64), params), np.asarray(tokens), model_def.config)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_parameters_are_named_counted_and_labelled(model):
    model_def, params, *_ = model
    cfg, kv, hd, d = model_def.config, SMALL["n_kv_heads"], SMALL["head_dim"], SMALL["d_model"]
    assert model_def.logical_specs["blocks"]["attn"]["prefix"]["k"] == jax.P("layers", "streams", None, "kv_heads", "head_dim")
    assert params["blocks"]["attn"]["prefix"]["v"].shape == (cfg.n_layers, P, 4, kv, hd)
    plain = model_lib.param_counts(_config())
    counts = model_lib.param_counts(cfg)
    prefixes, aggregator = cfg.n_layers * 2 * P * 4 * kv * hd, P * d * d + d + d * P + P
    assert counts.total == plain.total + prefixes + aggregator
    assert counts.active_matmul == plain.active_matmul + P * d * d + d * P  # prefixes are no matmul weights
    assert counts.stream_matmul == plain.stream_matmul
    attention = 6 * cfg.n_layers * cfg.n_heads * 2 * hd
    want = 6 * (plain.active_matmul + (P - 1) * plain.stream_matmul + P * d * d + d * P) + attention * P * (SEQ + 4)
    assert loss_lib.flops_per_token(cfg, SEQ) == want
    assert loss_lib.flops_per_token(_config(), SEQ) == 6 * plain.active_matmul + attention * SEQ
    label = labels.matrix_labels(params)
    assert label["blocks"]["attn"]["prefix"]["k"] == labels.ADAM and label["aggregate"]["hidden"]["kernel"] == labels.MATRIX


def test_one_stream_is_the_plain_model():
    """P = 1, whatever the other ParScale settings: the same parameters and the same program (so the same
    logits and loss, bit for bit) as the model without ParScale."""
    plain, one = _config(), _config(parscale=1, parscale_prefix_tokens=7, parscale_smoothing=0.5)
    defs = model_lib.define(plain), model_lib.define(one)
    assert defs[0].logical_specs == defs[1].logical_specs
    assert jax.tree.map(lambda x: x.shape, defs[0].abstract_params) == jax.tree.map(lambda x: x.shape, defs[1].abstract_params)
    assert model_lib.param_counts(one) == model_lib.param_counts(plain)
    assert loss_lib.flops_per_token(one, SEQ) == loss_lib.flops_per_token(plain, SEQ)
    params = _gaussian(defs[0].abstract_params, seed=4)
    tokens = jax.random.randint(jax.random.key(0), (2, SEQ), 0, VOCAB)
    programs = [str(jax.make_jaxpr(lambda p, d=d: loss_lib.next_token_loss(d, p, tokens)[0])(params)) for d in defs]
    assert programs[0] == programs[1]
    init = [str(jax.make_jaxpr(lambda d=d: model_lib.init_params(d, 0))()) for d in defs]
    assert init[0] == init[1]


def test_cached_decoding_with_streams_equals_the_full_forward(model):
    """Token by token from an empty cache of ``B P`` rows (prefill of several tokens: the generation test)."""
    model_def, params, tokens, _, logits = model
    cache = kv_cache.init(model_def.config, tokens.shape[0], SEQ)
    assert cache["k"].shape[1] == tokens.shape[0] * P
    decode = jax.jit(lambda p, t, c, s: model_lib.decode(model_def, p, t, c, s))
    steps = []
    for position in range(SEQ):
        step, cache = decode(params, tokens[:, position : position + 1], cache, jnp.int32(position))
        steps.append(step)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_with_streams_equals_argmax_of_the_full_forward(model):
    model_def, params, tokens, forward, _ = model
    out = sampling.make_generate(model_def, max_new_tokens=SEQ - 5, temperature=0.0)(params, tokens[:, :5], jax.random.key(0))
    full = forward(params, out)  # the fixture's shape: no new compile
    np.testing.assert_array_equal(out[:, 5:], jnp.argmax(full[:, 4:-1], axis=-1))


@pytest.mark.devices(8)
def test_streams_shard_as_batch_rows_and_equal_one_device(model):
    """Under FSDP + TP the ``B P`` stream rows split over data and fsdp like any batch; logits equal one device's."""
    model_def, params, tokens, forward, logits = model
    mesh, rules = mesh_lib.make_mesh("data:2,fsdp:2,tensor:2"), rules_lib.make_rules("tp")
    shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    with jax.set_mesh(mesh), partition.use_rules(rules):
        compiled = forward.lower(jax.device_put(params, shardings), tokens).compile()
        sharded = compiled(jax.device_put(params, shardings), tokens)
    np.testing.assert_allclose(sharded, logits, rtol=1e-5, atol=1e-5)
    assert f"f32[{BATCH * P // 4},{SEQ},{SMALL['d_model']}]" in compiled.as_text()  # a quarter of the rows per shard
    with jax.set_mesh(mesh_lib.make_mesh("stage:2,data:4")), pytest.raises(ValueError, match="stage"):
        jax.eval_shape(lambda p: model_lib.apply(model_def, p, tokens), params)


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="attention_type=gqa"):
        _config(parscale=2, attention_type="mla")
    with pytest.raises(ValueError, match="document_separator"):
        _config(parscale=2, document_separator=0)
    with pytest.raises(ValueError, match="parscale_smoothing"):
        _config(parscale=2, parscale_smoothing=2.0)
    with pytest.raises(hf.UnsupportedArchitecture, match="parscale"):
        hf.architecture(_config(parscale=2))
