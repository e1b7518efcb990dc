"""The lightning-attention model (`lm.lightning`): MiniMax-01's layer plan and decay rates, decoding from the
``d x d`` state token by token equal to the forward pass, document resets through the hybrid stack, and
memory: the decode step's flat in the context length (a KV cache's grows), the op's gradient linear in T
(softmax attention's XLA form quadratic), both read from compiled `memory_analysis` on CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import api as attention_api
from kernels_pallas.lightning import api as lightning_api
from lm import config, kv_cache, lightning
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

SEP = 1
CFG = config.ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=64,
    scan_layers=False, attention_type="lightning", softmax_attention_every=2, lightning_block=8, document_separator=SEP,
)  # fmt: skip


@pytest.fixture(scope="module")
def hybrid():
    model_def = model_lib.define(CFG)
    params = model_lib.init_params(model_def, 0)
    tokens = np.array(jax.random.randint(jax.random.key(1), (2, 19), 2, 64))
    tokens[:, 11] = SEP  # the second document starts mid-block
    forward = jax.jit(lambda p, t: model_lib.apply(model_def, p, t))
    return model_def, params, jnp.asarray(tokens), forward


def test_layer_plan_and_decay_rates_follow_minimax():
    every_4 = dataclasses.replace(CFG, n_layers=8, softmax_attention_every=4)
    assert [lightning.is_softmax_layer(every_4, i) for i in range(8)] == [False, False, False, True] * 2
    model_def = model_lib.define(CFG)
    assert set(model_def.abstract_params["blocks"][0]["attn"]) == {"qkv_proj", "output_gate", "norm", "out_proj"}
    assert set(model_def.abstract_params["blocks"][1]["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # s_h = 2^(-8 (h + 1) / H) (1 - l / (L - 1) + 1e-5): 8 heads, first and last of 80 layers.
    np.testing.assert_allclose(lightning.slopes(8, 0, 80), 0.5 ** (np.arange(8) + 1.0) * (1 + 1e-5), rtol=1e-6)
    np.testing.assert_allclose(lightning.slopes(8, 79, 80), 0.5 ** (np.arange(8) + 1.0) * (1 - 79 / (79 + 1e-5) + 1e-5), rtol=1e-4)
    with pytest.raises(ValueError, match="set model.scan_layers=False"):
        dataclasses.replace(CFG, scan_layers=True)
    with pytest.raises(ValueError, match="needs model.attention_type=lightning"):
        dataclasses.replace(CFG, attention_type="gqa")


def test_decoding_from_the_state_equals_the_forward_pass(hybrid):
    model_def, params, tokens, forward = hybrid
    plain = jnp.where(tokens == SEP, 2, tokens)  # decoding knows no documents
    want = forward(params, plain)
    decode = jax.jit(lambda p, t, c, s: model_lib.decode(model_def, p, t, c, s))
    cache = kv_cache.init(CFG, 2, 24)
    assert cache["state"].shape == (1, 2, 2, 16, 16) and cache["state"].dtype == jnp.float32 and cache["k"].shape[0] == 1
    logits, cache = decode(params, plain[:, :9], cache, jnp.int32(0))  # prefill: one whole block and a partial one
    steps = [logits]
    for t in range(9, 19):
        logits, cache = decode(params, plain[:, t : t + 1], cache, jnp.int32(t))
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, rtol=1e-4, atol=1e-4)


def test_a_document_boundary_resets_the_state(hybrid):
    _, params, tokens, forward = hybrid
    other_first_document = tokens.at[:, :11].set((tokens[:, :11] + 7) % 62 + 2)
    before, after = forward(params, tokens), forward(params, other_first_document)
    np.testing.assert_allclose(before[:, 11:], after[:, 11:], rtol=1e-5, atol=1e-5)
    assert not np.allclose(before[:, :11], after[:, :11], atol=1e-3)


def _memory(fn, *shapes) -> int:
    analysis = jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().memory_analysis()
    return analysis.temp_size_in_bytes + analysis.argument_size_in_bytes


def test_decode_step_memory_is_flat_in_the_context_where_a_kv_cache_grows():
    def step_memory(cfg, max_len):
        model_def = model_lib.define(cfg)
        cache = jax.eval_shape(lambda: kv_cache.init(cfg, 1, max_len))
        step = lambda p, c: model_lib.decode(model_def, p, jnp.ones((1, 1), jnp.int32), c, jnp.int32(0))
        lowered = jax.jit(step).lower(model_def.abstract_params, cache)
        analysis = lowered.compile().memory_analysis()
        return analysis.temp_size_in_bytes + analysis.argument_size_in_bytes

    linear = dataclasses.replace(CFG, n_layers=1, softmax_attention_every=0, max_seq_len=1024)
    softmax = dataclasses.replace(linear, attention_type="gqa", softmax_attention_every=0)
    assert step_memory(linear, 64) == step_memory(linear, 1024)
    assert step_memory(softmax, 1024) > step_memory(softmax, 64) + 2 * 16 * (1024 - 64) * 4


def test_gradient_memory_grows_linearly_in_the_sequence_where_softmax_grows_quadratically():
    def grad_memory(attend, seq):
        return _memory(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))), *[(1, seq, 1, 16)] * 3)

    def linear(q, k, v):
        return lightning_api.lightning_attention(q, k, v, jnp.full((1,), 0.1), block=16, implementation="xla")[0]

    def softmax(q, k, v):
        return attention_api.attention(q, k, v, implementation="xla")[0]

    ratio = {name: grad_memory(fn, 512) / grad_memory(fn, 64) for name, fn in (("lightning", linear), ("softmax", softmax))}
    assert ratio["lightning"] < 8 * 1.25, ratio  # T x 8
    assert ratio["softmax"] > 8 * 4, ratio  # T^2 x 64


@pytest.mark.devices(8)
def test_the_hybrid_shards_under_fsdp_and_tensor_parallelism(hybrid):
    model_def, params, tokens, forward = hybrid
    tokens = jnp.concatenate([tokens, tokens[:, ::-1]])  # 4 rows: one per data x fsdp shard
    single = forward(params, tokens)
    mesh, rules = mesh_lib.make_mesh("data:2,fsdp:2,tensor:2"), rules_lib.make_rules("tp")
    shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    assert shardings["blocks"][0]["attn"]["qkv_proj"]["kernel"].spec == jax.P("fsdp", "tensor")
    with jax.set_mesh(mesh), partition.use_rules(rules):
        sharded = forward(jax.device_put(params, shardings), tokens)
    np.testing.assert_allclose(sharded, single, atol=1e-4, rtol=1e-4)
