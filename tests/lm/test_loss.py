"""The chunked LM head + loss (`lm.loss.chunked_cross_entropy`) equals the whole-logits loss and never holds them."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import train_lib
from lm import config as config_lib
from lm import loss as loss_lib
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

VOCAB = 320


def _config(tie: bool, chunk: str, **overrides) -> config_lib.ModelConfig:
    return config_lib.from_preset("tiny", n_layers=1, vocab_size=VOCAB, tie_embeddings=tie, loss_chunk=chunk, **overrides)


def _value_and_grad(cfg, params, tokens, z_loss):
    model_def = model_lib.define(cfg)
    return jax.jit(jax.value_and_grad(lambda p: loss_lib.next_token_loss(model_def, p, tokens, z_loss=z_loss)[0]))(params)


@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_and_gradients_equal_whole_logits(tie):
    cfg = _config(tie, "none")
    params = model_lib.init_params(model_lib.define(cfg), 0)
    tokens = jax.random.randint(jax.random.key(1), (4, 25), 0, VOCAB)
    whole, whole_grads = _value_and_grad(cfg, params, tokens, 1e-2)
    chunked_cfg = dataclasses.replace(cfg, loss_chunk="24")  # 6 positions of 4 rows: 4 chunks
    assert loss_lib.loss_chunks(chunked_cfg, 4, 24) == 4
    chunked, chunked_grads = _value_and_grad(chunked_cfg, params, tokens, 1e-2)
    np.testing.assert_allclose(chunked, whole, rtol=2e-6)
    for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(whole_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_chunked_metrics_split_nll_and_z_loss():
    rng = np.random.default_rng(0)
    h, w = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32), jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (2, 8)))
    loss, metrics = loss_lib.chunked_cross_entropy(h, w, targets, z_loss=0.1, chunks=2, vocab_first=False)
    want_loss, want = loss_lib.cross_entropy(h @ w, targets, z_loss=0.1)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for key in ("nll", "z_loss"):
        np.testing.assert_allclose(metrics[key], want[key], rtol=1e-6)


def test_bf16_chunked_loss_is_close_to_whole():
    """In bf16 the chunked logits skip the bf16 rounding of the whole logits: close, not equal."""
    cfg = _config(True, "none", dtype="bfloat16")
    params = model_lib.init_params(model_lib.define(cfg), 0)
    tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, VOCAB)
    whole, g_whole = _value_and_grad(cfg, params, tokens, 0.0)
    chunked, g_chunked = _value_and_grad(dataclasses.replace(cfg, loss_chunk="16"), params, tokens, 0.0)
    np.testing.assert_allclose(chunked, whole, rtol=1e-2)
    e_whole, e_chunked = g_whole["embed"]["embedding"], g_chunked["embed"]["embedding"]
    assert float(jnp.linalg.norm(e_chunked - e_whole)) < 0.05 * float(jnp.linalg.norm(e_whole))


def test_loss_chunks_setting():
    gpt2 = config_lib.from_preset("gpt2-124m")
    assert gpt2.loss_chunk == "auto"
    n = loss_lib.loss_chunks(gpt2, 16, 1024)  # 3.3 GB of float32 logits whole
    assert n > 1 and 16 * 1024 // n * 50304 * 4 <= loss_lib.AUTO_CHUNK_BYTES
    assert loss_lib.loss_chunks(config_lib.from_preset("tiny"), 16, 128) == 1  # 2 MiB: whole
    assert loss_lib.loss_chunks(gpt2, 16, 1024, device_memory=141 * 10**9) == 1  # an H200: 3.3 GB is 1/43 of it
    assert loss_lib.loss_chunks(gpt2, 16, 1024, device_memory=16 * 2**30) == 4  # 16 GiB: chunks of at most 1 GiB
    assert loss_lib.loss_chunks(config_lib.from_preset("tiny", loss_chunk="none"), 4096, 4096) == 1
    assert loss_lib.loss_chunks(config_lib.from_preset("tiny", loss_chunk=100), 4, 60) == 3  # 4 x 20 <= 100
    with pytest.raises(ValueError, match="model.loss_chunk"):
        config_lib.from_preset("tiny", loss_chunk="half")


def test_auto_chunks_follow_the_device_memory_assumed_for_a_plan():
    """`assume_device_memory` (the planner's) sizes auto chunks as that device would, whatever this process runs
    on: 64 x 4096 tokens of a 320-word vocabulary are 335 MB of float32 logits, chunked on a 1 GiB device (256
    MiB chunks at least), whole on an H200."""
    cfg = config_lib.from_preset("tiny")
    model_def = model_lib.define(cfg)
    tokens = jax.ShapeDtypeStruct((64, 4097), jnp.int32)

    def trips():
        jaxpr = jax.make_jaxpr(lambda p, t: loss_lib.next_token_loss(model_def, p, t)[0])(model_def.abstract_params, tokens)
        return [int(n) for n in re.findall(r"\blength=(\d+)", str(jaxpr))]

    with loss_lib.assume_device_memory(2**30):
        layers, *chunks = trips()  # the layer scan's length, then the chunk loop's
    assert cfg.vocab_size == 320 and chunks == [loss_lib.loss_chunks(cfg, 64, 4096, device_memory=2**30)] and chunks[0] > 1
    with loss_lib.assume_device_memory(141 * 10**9):
        assert trips() == [layers]


@pytest.mark.devices(8)
def test_loss_chunks_hold_the_limit_per_device_not_per_step():
    """On 8 devices that split the batch, a chunk may hold 8 times the tokens: the chunk loop runs 8 times fewer
    trips, each of which reduces the head's gradient over the devices (llama-1b on 128 devices: 1024 trips)."""
    cfg = _config(False, "16")
    model_def = model_lib.define(cfg)
    tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32)

    def trips(mesh_shape):
        mesh = jax.make_mesh(mesh_shape, ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        with jax.set_mesh(mesh), partition.use_rules(rules_lib.make_rules("dp")):
            jaxpr = jax.make_jaxpr(lambda p, t: loss_lib.next_token_loss(model_def, p, t)[0])(model_def.abstract_params, tokens)
        return [int(n) for n in re.findall(r"\blength=(\d+)", str(jaxpr))]  # the scans' lengths: the layers', the chunks'

    assert trips((1, 8)) == [1, loss_lib.loss_chunks(cfg, 8, 16)] == [1, 8]  # one data shard: chunks of 8 x 2 tokens
    assert trips((8, 1)) == [1]  # 8 data shards: 16 tokens per device, the whole logits, no chunk loop


def _train_step_temp_bytes(cfg, batch, seq):
    model_def = model_lib.define(cfg)
    tx = optax.sgd(0.1)
    counters = {k: jax.ShapeDtypeStruct((), jnp.int32) for k in ("step", "bad_streak", "skipped")}
    state = {"params": model_def.abstract_params, "opt_state": jax.eval_shape(tx.init, model_def.abstract_params), **counters}
    step = jax.jit(train_lib.make_train_step(model_def, tx))
    compiled = step.lower(state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_train_step_peak_memory_drops_by_the_logits():
    """At a shape where the logits dominate, the compiled step's temporaries shrink by more than the float32 logits."""
    batch, seq, vocab = 4, 64, 8192
    small = dict(d_model=64, n_heads=2, n_kv_heads=1, mlp_dim=128, vocab_size=vocab)
    whole = _train_step_temp_bytes(config_lib.from_preset("tiny", n_layers=1, loss_chunk="none", **small), batch, seq)
    chunked = _train_step_temp_bytes(config_lib.from_preset("tiny", n_layers=1, loss_chunk="64", **small), batch, seq)
    assert whole - chunked >= batch * seq * vocab * 4


@pytest.mark.devices(8)
@pytest.mark.parametrize("tie", [True, False])
def test_chunked_loss_on_a_vocab_sharded_head(tie):
    """Under tensor parallelism (the head split over vocabulary) and FSDP the chunked loss equals the whole one."""
    mesh, rules = mesh_lib.make_mesh("tensor:2,fsdp:4"), rules_lib.make_rules("tp")
    tokens = jax.random.randint(jax.random.key(3), (8, 33), 0, VOCAB)
    out = {}
    for chunk in ("none", "64"):
        cfg = _config(tie, chunk)
        model_def = model_lib.define(cfg)
        shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
        with jax.set_mesh(mesh), partition.use_rules(rules):
            params = model_lib.init_params(model_def, 0, shardings)
            grad = jax.value_and_grad(lambda p: loss_lib.next_token_loss(model_def, p, tokens)[0])  # noqa: B023
            out[chunk] = jax.jit(grad, in_shardings=(shardings,), out_shardings=(None, shardings))(params)
    (whole, g_whole), (chunked, g_chunked) = out["none"], out["64"]
    np.testing.assert_allclose(chunked, whole, rtol=2e-6)
    for got, want in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_whole), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_chunked_path_keeps_the_attention_max_logits():
    """MuonClip's ``attn_max_logits`` leave the model beside the chunked loss as beside the whole one."""
    cfg = dataclasses.replace(_config(True, "none", track_attn_logits=True), n_layers=2)
    params = model_lib.init_params(model_lib.define(cfg), 0)
    tokens = jax.random.randint(jax.random.key(4), (2, 17), 0, VOCAB)
    whole = loss_lib.next_token_loss(model_lib.define(cfg), params, tokens)[2]
    chunked = loss_lib.next_token_loss(model_lib.define(dataclasses.replace(cfg, loss_chunk="8")), params, tokens)[2]
    assert whole["attn_max_logits"].shape == (2, cfg.n_heads)
    np.testing.assert_allclose(chunked["attn_max_logits"], whole["attn_max_logits"], rtol=1e-6)
