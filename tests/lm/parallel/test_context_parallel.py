"""Context parallelism (`lm.parallel.context_attention`): each mode equals one device; the ring's causal work is balanced."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from experiments import hlo_bytes, run_spec
from experiments.cli import UsageError
from experiments.configs import default
from kernels_pallas.attention import reference
from lm import config as config_lib
from lm import loss as loss_lib
from lm import model as model_lib
from lm import remat
from lm.parallel import context_attention
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

SEQ_LEN, BATCH = 256, 4
MESHES = [("context:4,data:2", "fsdp"), ("context:2,fsdp:2,tensor:2", "tp")]
SEPARATOR = 7


def _model(mode: str, **overrides):
    """`tiny` with packed documents, reporting its attention max logits (all three are compared)."""
    # Ulysses splits each device's heads over the context shards: tiny's 2 kv heads would not split 4 ways.
    heads = {"n_kv_heads": 4} if mode == "ulysses" else {}
    cfg = config_lib.from_preset(
        "tiny", context_parallel=mode, track_attn_logits=True, document_separator=SEPARATOR, **heads, **overrides
    )
    return model_lib.define(cfg)


MLA = {"attention_type": "mla", "kv_lora_rank": 24, "v_head_dim": 20}


def _tokens(model_def):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model_def.config.vocab_size, (BATCH, SEQ_LEN + 1), dtype=np.int32)
    tokens[:, rng.integers(1, SEQ_LEN, 12)] = SEPARATOR  # several documents per row, crossing shard boundaries
    return tokens


def _loss(params, model_def, tokens, model_layout: bool):
    """The token mean of the train step (logits and targets in the model's layout), or of logits in order."""
    logits, aux = model_lib.apply(model_def, params, tokens[:, :-1], return_aux=True, model_layout=model_layout)
    targets = model_lib.in_model_layout(model_def, tokens[:, 1:]) if model_layout else tokens[:, 1:]
    return loss_lib.cross_entropy(logits, targets)[0], aux["attn_max_logits"]


def loss_and_grads(model_def, spec=None, rules_name="fsdp", model_layout=True):
    """``(loss, grads, attention max logits)`` of one batch: on one device, or on mesh ``spec`` under ``rules_name``."""
    params = model_lib.init_params(model_def, 0)
    tokens = _tokens(model_def)
    step = jax.jit(jax.value_and_grad(lambda p, t: _loss(p, model_def, t, model_layout), has_aux=True))
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


@pytest.fixture(scope="module")
def one_device_mla():
    return loss_and_grads(_model("all_gather", **MLA))


@pytest.mark.devices(8)
@pytest.mark.parametrize("mode, spec, rules_name", [("all_gather", *MESHES[1]), ("ring", *MESHES[0])])
def test_mla_equals_one_device(one_device_mla, mode, spec, rules_name):
    """(Through the logits inverted to sequence order, as evaluation and sampling read them.)"""
    _assert_same(loss_and_grads(_model(mode, **MLA), spec, rules_name, model_layout=False), one_device_mla)


@pytest.mark.devices(8)
@pytest.mark.parametrize("mode", ["all_gather", "ring"])
def test_mla_sends_the_latent_not_per_head_keys(mode):
    """The compiled forward moves each layer's latent and RoPE key (and positions), never per-head K/V."""
    model_def = _model(mode, **MLA, scan_unroll=1)  # a rolled scan: per-layer collectives sit in its loop
    cfg, shards = model_def.config, 8
    mesh, rules = mesh_lib.make_mesh(f"context:{shards}"), rules_lib.make_rules("fsdp")
    tokens = jax.ShapeDtypeStruct((1, SEQ_LEN), np.int32)
    with jax.set_mesh(mesh), partition.use_rules(rules):
        hlo = jax.jit(lambda p, t: model_lib.apply(model_def, p, t)).lower(model_def.abstract_params, tokens).compile().as_text()
    # Inside the scanned layers (positions and segment ids are loop-invariant: gathered once, before).
    per_layer = [c for c in hlo_bytes.collectives(hlo, shards) if c.count % cfg.n_layers == 0]
    sent = sum(c.ring * c.count for c in per_layer) / cfg.n_layers
    shard = SEQ_LEN // shards
    latent = shard * (cfg.kv_lora_rank + cfg.rope_head_dim) * 4
    per_head_kv = cfg.n_heads * (cfg.head_dim + cfg.rope_head_dim + cfg.value_head_dim) * shard * 4
    # One latent + RoPE key shard from each other device (all-gathered, or C - 1 ring hops, where the segment ids
    # travel with them), and nothing else: the sequence is zig-zag from the model's input on, no call re-lays it out.
    segment_ids = shard * 4 if mode == "ring" else 0
    assert (shards - 1) * latent <= sent <= (shards - 1) * (latent + segment_ids)
    assert sent < (shards - 1) * per_head_kv / 2


def _saved_by_remat(mode: str, spec: str) -> tuple[list[str], int]:
    """Under ``save_attention``: the names of the residuals one MLA layer keeps, and how many come out of a shard_map."""
    cfg = config_lib.from_preset(
        "tiny", context_parallel=mode, remat="save_attention", n_layers=1, scan_layers=False, document_separator=SEPARATOR, **MLA
    )
    model_def = model_lib.define(cfg)
    tokens = np.zeros((2, 64), np.int32)

    def loss(params):
        return loss_lib.cross_entropy(model_lib.apply(model_def, params, tokens), tokens)[0]

    mesh = mesh_lib.make_mesh(spec, jax.devices()[:1]) if spec == "data:1" else mesh_lib.make_mesh(spec)
    printed = io.StringIO()
    with jax.set_mesh(mesh), partition.use_rules(rules_lib.make_rules("fsdp")), contextlib.redirect_stdout(printed):
        print_saved_residuals(loss, model_def.abstract_params)
    saved = printed.getvalue().splitlines()
    return sorted({re.search(r"named '(\w+)'", s)[1] for s in saved if "named '" in s}), sum("output of shard_map" in s for s in saved)


@pytest.mark.devices(8)
@pytest.mark.parametrize("mode", context_attention.MODES)
def test_remat_keeps_the_same_attention_values_under_a_context_split(mode):
    """MLA's latent and RoPE key carry the key/value names, and the softmax statistics of the per-shard attention
    are kept (they come out of the shard_map unnamed), so the backward never reruns attention's forward."""
    one_device, _ = _saved_by_remat(mode, "data:1")
    names, from_shard_map = _saved_by_remat(mode, "context:4,data:2")
    assert names == [n for n in one_device if n != reference.RESIDUAL_NAME]
    assert {remat.ATTN_Q, remat.ATTN_K, remat.ATTN_V, remat.ATTN_CONTEXT} <= set(names)
    assert from_shard_map == 2  # the attention's output and log-sum-exp


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_ring_schedule_covers_every_causal_block_with_equal_work(shards):
    """Zig-zag ring: each device computes the same number of half-chunk blocks, and every skipped block is fully masked."""
    half = 3
    positions = context_attention.zigzag_order(2 * shards * half, shards).reshape(shards, 2, half)
    schedule = context_attention.ring_schedule(shards)
    for device in range(shards):
        for hop in range(shards):
            source = (device - hop) % shards
            for q_half in range(2):
                for k_half in range(2):
                    sees = positions[source, k_half].min() <= positions[device, q_half].max()
                    assert schedule[device, hop, q_half, k_half] or not sees, (device, hop, q_half, k_half)
    work = schedule.sum(axis=(1, 2, 3))
    assert (work == work[0]).all() and work[0] == 4 + 2 * (shards - 1)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_contiguous_chunks_would_leave_causal_work_unequal(shards):
    """Without the zig-zag, device i's queries see i + 1 of the C key chunks: the ring's reason to permute."""
    chunks = np.arange(shards)
    blocks_seen = (chunks[None, :] <= chunks[:, None]).sum(axis=1)
    zigzag = context_attention.zigzag_order(2 * shards, shards).reshape(shards, 2)
    zigzag_seen = (zigzag.reshape(-1)[None, None, :] <= zigzag[:, :, None]).sum(axis=(1, 2))
    assert blocks_seen.tolist() == list(range(1, shards + 1))
    assert (zigzag_seen == zigzag_seen[0]).all()


def test_zigzag_order_needs_two_chunks_per_shard():
    with pytest.raises(ValueError, match="multiple of 8"):
        context_attention.zigzag_order(36, 4)


@pytest.mark.devices(8)
def test_ulysses_names_heads_that_do_not_split():
    model_def = model_lib.define(config_lib.from_preset("tiny", context_parallel="ulysses"))
    mesh, rules = mesh_lib.make_mesh("context:4,data:2"), rules_lib.make_rules("fsdp")
    tokens = np.zeros((2, 32), np.int32)
    with jax.set_mesh(mesh), partition.use_rules(rules), pytest.raises(ValueError, match="4 query and 2 key/value heads over 4"):
        jax.eval_shape(lambda p: model_lib.apply(model_def, p, tokens), model_def.abstract_params)


@pytest.mark.devices(8)
@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_kernel_blocks_and_hand_written_backward_equal_the_reference(mode):
    """Ring and all-gather hops with the Triton kernel (interpret mode) against whole-sequence attention.

    (With XLA blocks they are `test_mode_equals_one_device`'s.)
    """
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v, d_out = normal(2, 32, 2, 16), normal(2, 32, 1, 16), normal(2, 32, 1, 16), normal(2, 32, 2, 16)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 32)), axis=1), jnp.int32)

    def expected(q, k, v):
        return reference.attention(q, k, v, segment_ids=seg, return_max_logits=True)

    def ring(q, k, v):
        return context_attention.attend(q, k, v, mode=mode, implementation="pallas", track_max_logits=True, segment_ids=seg)

    (want, want_max), vjp = jax.vjp(expected, q, k, v)
    want_grads = vjp((d_out, jnp.zeros_like(want_max)))
    with jax.set_mesh(mesh_lib.make_mesh("context:4,data:2")), partition.use_rules(rules_lib.make_rules("fsdp")):
        assert "pallas_call" in str(jax.make_jaxpr(ring)(q, k, v))  # the kernel runs, no XLA fallback
        (got, got_max), vjp = jax.vjp(jax.jit(ring), q, k, v)
        got_grads = vjp((d_out, jnp.zeros_like(got_max)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_max, want_max, rtol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "mode, seq_len, match",
    [("ring", 36, "seq_len=36 into 8 chunks"), ("ulysses", 64, "2 key/value heads over 1 head shard")],
)
def test_run_spec_names_sizes_that_do_not_split(mode, seq_len, match):
    config = default.get_config()
    config.mesh, config.model.preset, config.model.context_parallel, config.data.seq_len = "context:4,data:2", "tiny", mode, seq_len
    with pytest.raises(UsageError, match=match):
        run_spec.build_run(config)


@pytest.mark.devices(8)
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_zigzag_relayout_by_ppermute_and_back(shards):
    mesh = mesh_lib.make_mesh(f"context:{shards}", jax.devices()[:shards])
    positions = np.arange(4 * shards)

    def run(fn):
        return jax.shard_map(lambda x: fn(x, "context", 0), mesh=mesh, in_specs=jax.P("context"), out_specs=jax.P("context"))

    zigzag = run(context_attention._to_zigzag)(positions)
    np.testing.assert_array_equal(zigzag, context_attention.zigzag_order(4 * shards, shards))
    np.testing.assert_array_equal(run(context_attention._from_zigzag)(zigzag), positions)
