"""The speedrun options (lm/speedrun_blocks.py) against a NumPy transcription of modded-nanogpt's record 21.

One model turns every option on; its parameters are drawn at random (the zero head and the (1, 0)
lambdas would hide terms) and its logits compared with `_numpy_logits`, written from the record's
``GPT.forward`` / ``Block`` / ``CausalSelfAttention`` / ``MLP`` with this codebase's RoPE and
weight layout ``(fan_in, fan_out)``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import api as attention_api
from kernels_pallas.attention import window as window_lib
from lm import config as config_lib
from lm import kv_cache, speedrun_config
from lm import model as model_lib

CFG = config_lib.ModelConfig(
    vocab_size=64, embed_vocab_size=60, d_model=32, n_layers=4, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=48,
    max_seq_len=32, tie_embeddings=False, qk_norm=True, scan_layers=False, mlp_activation="relu2", zero_init_head=True,
    logit_softcap=3.0, norm_scale=False, attention_scale=0.3, value_embeddings=1, unet_skips=True, x0_mixing=True,
    skip_attention="2", attention_window=8, window_block=4, window_pattern="LSLL", document_separator=5,
)
TOKENS = np.random.default_rng(0).integers(0, 60, (2, 16))


def _rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, theta):  # (seq, heads, d): pairs (x_i, x_{i + d/2}) turned by position * theta^(-i / (d/2))
    half = x.shape[-1] // 2
    angles = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _window_mask(t, window, block, segments):
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    return (j <= i) & (i // block - j // block < window // block) & (segments[:, None] == segments[None, :])


def _numpy_logits(cfg, p, tokens):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    eps, n = cfg.norm_eps, cfg.n_layers
    out = []
    for seq in tokens:
        t = len(seq)
        segments = np.cumsum(seq == cfg.document_separator)
        x = x0 = _rms(p["embed"]["embedding"][seq], eps)
        ve = [table["embedding"][seq] for table in p["value_embeds"].values()]
        ve = ve + [None] * (n - 2 * len(ve)) + ve  # the record's "012 ... 012"
        skips = []
        for layer in range(n):
            blk = p["blocks"][layer]
            if layer >= n // 2:
                x = x + p["skip_weights"][layer - n // 2] * skips.pop()
            x = blk["x0_lambdas"][0] * x + blk["x0_lambdas"][1] * x0
            if "attn" in blk:
                a, h = blk["attn"], _rms(x, eps)
                q, k, v = (h @ a[f"{name}_proj"]["kernel"] for name in "qkv")
                q, k, v = (m.reshape(t, cfg.n_heads, cfg.head_dim) for m in (q, k, v))
                q, k = _rope(_rms(q, eps), cfg.rope_theta), _rope(_rms(k, eps), cfg.rope_theta)
                v = a["v_lambdas"][0] * v + (0 if ve[layer] is None else a["v_lambdas"][1] * ve[layer].reshape(v.shape))
                w = cfg.attention_window // (2 if cfg.window_pattern[layer] == "S" else 1)
                s = np.einsum("ihd,jhd->hij", q, k) * cfg.attention_scale
                s = np.where(_window_mask(t, w, cfg.window_block, segments)[None], s, -np.inf)
                prob = np.exp(s - s.max(-1, keepdims=True))
                prob /= prob.sum(-1, keepdims=True)
                x = x + np.einsum("hij,jhd->ihd", prob, v).reshape(t, -1) @ a["o_proj"]["kernel"]
            m = blk["mlp"]
            x = x + np.maximum(_rms(x, eps) @ m["up_proj"]["kernel"], 0) ** 2 @ m["down_proj"]["kernel"]
            if layer < n // 2:
                skips.append(x)
        z = _rms(x, eps) @ p["lm_head"]["kernel"]
        out.append(cfg.logit_softcap * np.tanh(z / cfg.logit_softcap))
    return np.stack(out)


@pytest.fixture(scope="module")
def model():
    model_def = model_lib.define(CFG)
    params = model_lib.init_params(model_def, 0)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(1)
    drawn = [jnp.asarray(rng.normal(0.0, 0.3, leaf.shape), jnp.float32) for leaf in leaves]
    return model_def, params, jax.tree.unflatten(tree, drawn)


def test_every_option_matches_the_numpy_transcription(model):
    model_def, _, params = model
    logits = jax.jit(lambda p, t: model_lib.apply(model_def, p, t))(params, jnp.asarray(TOKENS))
    np.testing.assert_allclose(np.asarray(logits), _numpy_logits(CFG, params, TOKENS), rtol=2e-4, atol=2e-4)


def test_parameters_the_options_add(model):
    _, params, _ = model
    assert not np.any(np.asarray(params["lm_head"]["kernel"]))  # the zero head
    np.testing.assert_array_equal(params["skip_weights"], [1.0, 1.0])
    np.testing.assert_array_equal(params["blocks"][0]["x0_lambdas"], [1.0, 0.0])
    np.testing.assert_array_equal(params["blocks"][0]["attn"]["v_lambdas"], [0.5, 0.5])
    assert "attn" not in params["blocks"][2] and "attn_norm" not in str(params)  # no scale on any norm
    assert params["embed"]["embedding"].shape == params["value_embeds"][0]["embedding"].shape == (60, 32)
    assert params["lm_head"]["kernel"].shape == (32, 64)
    assert params["blocks"][1]["mlp"].keys() == {"up_proj", "down_proj"}
    assert speedrun_config.attended_keys(CFG, 16) == 8 + 4 + 8  # blocks 0, 1, 3 (L, S, L); none in block 2
    assert speedrun_config.attended_keys(dataclasses.replace(CFG, attention_window=0, window_pattern=""), 16) == 3 * 16


def _dense_window(q, k, v, window, block, segments):
    t, d = q.shape[1], q.shape[3]
    allowed = jnp.stack([_window_mask(t, window, block, s) for s in np.asarray(segments)])[:, None]
    s = jnp.einsum("bihd,bjhd->bhij", q, k) * d**-0.5
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1), v)


@pytest.mark.parametrize("window, block", [(5, 1), (8, 4)])
def test_banded_window_attention_matches_the_masked_definition(window, block):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 24, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 8)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.cumsum(rng.random((2, 24)) < 0.1, axis=1))
    kv = lambda x: jnp.repeat(x, 2, axis=2)  # noqa: E731  grouped-query: head h reads kv head h // 2
    run = lambda q, k, v: window_lib.attention(q, k, v, window=window, block=block, segment_ids=segments)  # noqa: E731
    ref = lambda q, k, v: _dense_window(q, kv(k), kv(v), window, block, segments)  # noqa: E731
    np.testing.assert_allclose(jax.jit(run)(q, k, v), jax.jit(ref)(q, k, v), rtol=1e-5, atol=1e-5)
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))), (0, 1, 2)))(q, k, v) for f in (run, ref)]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_windowed_attention_choice():
    q = jnp.zeros((1, 8, 2, 8))
    out, _ = jax.jit(lambda x: attention_api.attention(x, x, x, implementation="auto", window_size=4, window_block=2))(q)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="without tracked max logits"):
        attention_api.attention(q, q, q, implementation="pallas", window_size=4, track_max_logits=True)
    with pytest.raises(ValueError, match="cudnn cannot run this windowed attention: cuDNN needs an NVIDIA GPU"):
        attention_api.attention(q, q, q, implementation="cudnn", window_size=4)
    with pytest.raises(ValueError, match="cudnn cannot run this windowed attention: cuDNN's sliding window is static"):
        attention_api.attention(q, q, q, implementation="cudnn", window_size=4, window_limit=jnp.int32(2))


def test_windowed_attention_hands_the_kernel_its_window_per_shard(monkeypatch):
    """``pallas`` (interpreted on a CPU) gets the window, its block and the traced limit, and is called per shard
    without segment ids as `lm.attention` calls it; the kernel's numerics: tests/kernels_pallas/attention."""
    calls = []

    def kernel(q, k, v, *, segment_ids, window, window_block, window_limit, interpret):
        calls.append((segment_ids, window, window_block, int(window_limit), interpret))
        return window_lib.attention(q, k, v, window=window, block=window_block, limit=window_limit)

    monkeypatch.setattr(attention_api, "flash_attention", kernel)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 8)), jnp.float32)
    per_shard = lambda run: lambda q, k, v, segment_ids=None: run(q, k, v)  # noqa: E731
    out, _ = attention_api.attention(x, x, x, implementation="pallas", window_size=4, window_block=2, window_limit=jnp.int32(1), per_shard=per_shard)
    assert calls == [(None, 4, 2, 1, True)]
    np.testing.assert_array_equal(out, window_lib.attention(x, x, x, window=4, block=2, limit=1))


def test_option_errors_name_the_fix():
    with pytest.raises(ValueError, match="model.scan_layers=False"):
        dataclasses.replace(CFG, scan_layers=True)
    with pytest.raises(ValueError, match="tie_embeddings=False"):
        dataclasses.replace(CFG, tie_embeddings=True, embed_vocab_size=0)
    with pytest.raises(ValueError, match="one letter L"):
        dataclasses.replace(CFG, window_pattern="LSX")
    with pytest.raises(ValueError, match="track_attn_logits needs full attention .* model.attention_window=0"):
        dataclasses.replace(CFG, skip_attention="", track_attn_logits=True)  # refused as the config is made, not at the step


def test_speedrun_preset_has_the_records_parameter_count():
    """Record 21's GPT(vocab_size=50257, num_layers=12, num_heads=6, model_dim=768), parameter by parameter."""
    vocab, padded, d, layers, hidden = 50257, 50304, 768, 12, 4 * 768  # lm_head: next multiple of 128
    embed = vocab * d
    value_embeds = 3 * vocab * d  # ValueEmbedding(num_embeddings=3)
    attention = 3 * d * d + 2 + d * d  # qkv_w (3, 6 * 128, d), lambdas (2,), c_proj
    mlp = d * hidden + hidden * d
    blocks = (layers - 1) * attention + layers * (mlp + 2)  # no attention in block 7; Block.lambdas (2,)
    record = embed + value_embeds + blocks + layers // 2 + padded * d  # skip_weights, lm_head
    assert model_lib.param_counts(config_lib.from_preset("speedrun-124m")).total == record == 275_598_388


def test_window_warmup_gives_the_records_windows():
    """Record 21: ``window_size = next_multiple_of_n(1728 * step / 1770, n=128)`` (long), ``// 2`` blocks (short),
    where a block mask of 0 blocks still keeps the diagonal block (``clamp_min(..., 1)`` in ``build_bm``)."""
    cfg = dataclasses.replace(config_lib.from_preset("speedrun-124m"), window_warmup=1770)
    steps = np.arange(1771)
    record = np.array([next(x for x in range(128, int(1728 * s / 1770) + 1 + 128, 128) if x >= 1728 * s / 1770) for s in steps])
    long = np.asarray(speedrun_config.window_blocks(cfg, steps))
    np.testing.assert_array_equal(long * 128, record)
    assert record[[0, 125, 250, 1180, 1770]].tolist() == [128, 128, 256, 1152, 1792]
    assert np.asarray(speedrun_config.window_blocks(cfg, 5000)) == 14  # full after the warmup
    short = np.asarray(speedrun_config.layer_window_blocks(cfg, 1, jnp.asarray(long)))  # layer 1 is an S
    np.testing.assert_array_equal(short, np.maximum(record // 128 // 2, 1))
    np.testing.assert_array_equal(speedrun_config.layer_window_blocks(cfg, 0, jnp.asarray(long)), long)  # an L


def test_window_warmup_on_a_uniform_stack_initialises_like_its_static_window():
    """With no option that makes blocks differ, a stack is initialised stacked whatever ``scan_layers``; the
    warmup (a schedule, which only an unrolled stack runs) must not stop that, nor change a value."""
    cfg = config_lib.ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=48, max_seq_len=32,
        scan_layers=False, attention_window=8, window_block=4,
    )
    warm = model_lib.init_params(model_lib.define(dataclasses.replace(cfg, window_warmup=10)), 0)
    jax.tree.map(np.testing.assert_array_equal, warm, model_lib.init_params(model_lib.define(cfg), 0))


def test_a_traced_window_inside_the_band_matches_the_masked_definition():
    q, k, v = (jnp.asarray(np.random.default_rng(i).normal(size=(2, 32, 2, 8)), jnp.float32) for i in range(3))
    segments = jnp.asarray(np.repeat([[0, 1], [0, 0]], [20, 12], axis=1))
    run = jax.jit(lambda q, k, v, limit: window_lib.attention(q, k, v, window=12, block=4, segment_ids=segments, limit=limit))
    for limit in (1, 3):  # one compilation, two windows
        np.testing.assert_allclose(run(q, k, v, limit), _dense_window(q, k, v, 4 * limit, 4, segments), rtol=1e-5, atol=1e-6)


def test_the_model_at_a_grown_window_equals_the_static_window(model):
    model_def, _, params = model
    run = jax.jit(lambda p, t, w: model_lib.apply(model_def, p, t, window_blocks=w))
    one_block = dataclasses.replace(CFG, window_pattern="SSSS")  # at n = 1 the L and S windows are both 1 block
    np.testing.assert_allclose(np.asarray(run(params, TOKENS, 1)), _numpy_logits(one_block, params, TOKENS), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(run(params, TOKENS, 2)), _numpy_logits(CFG, params, TOKENS), rtol=2e-4, atol=2e-4)


def test_prefill_and_step_by_step_decode_equal_the_full_forward(model):
    """The speedrun stack decodes from a KV cache (value embeddings, U-net skips, x0 mixing, a block without
    attention, long/short block windows), against the NumPy transcription; no separator in the tokens
    (decoding masks no documents)."""
    model_def, _, params = model
    tokens = np.where(TOKENS == CFG.document_separator, 6, TOKENS)
    full = _numpy_logits(CFG, params, tokens)
    decode = jax.jit(lambda p, t, c, s: model_lib.decode(model_def, p, t, c, s))
    logits, cache = decode(params, tokens[:, :5], kv_cache.init(CFG, 2, 16), jnp.int32(0))
    steps = [logits]
    for t in range(5, 16):
        logits, cache = decode(params, tokens[:, t : t + 1], cache, jnp.int32(t))
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=2e-4, atol=2e-4)
