"""Hugging Face checkpoints (lm/hf.py): our logits equal an independent NumPy forward pass of the
exported transformers layout, and export -> import gives bit-identical parameters on a mesh."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lm import config as config_lib
from lm import hf
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=48, max_seq_len=64, norm_eps=1e-5)
CONFIGS = {
    "llama": config_lib.ModelConfig(**SMALL),
    "llama_untied_unrolled": config_lib.ModelConfig(**SMALL, tie_embeddings=False, scan_layers=False, rope_theta=500.0),
    "qwen3": config_lib.ModelConfig(**SMALL, qk_norm=True),
    "mixtral": config_lib.ModelConfig(  # every block MoE: mlp_dim is the experts' width
        **SMALL | dict(mlp_dim=16), tie_embeddings=False, n_experts=4, experts_per_token=2, expert_mlp_dim=16,
        normalize_router_weights=True,
    ),
    "qwen3_moe": config_lib.ModelConfig(  # the first block dense, then MoE every second block, gates not renormalised
        **SMALL | dict(n_layers=4), qk_norm=True, n_experts=4, experts_per_token=2, expert_mlp_dim=16, moe_every=2,
        first_dense_layers=1, scan_layers=False,
    ),
    "deepseek_v2": config_lib.ModelConfig(  # MLA, a dense first block, routed + shared experts, query LoRA
        **SMALL | dict(n_layers=3, n_kv_heads=4), tie_embeddings=False, attention_type="mla", kv_lora_rank=12, q_lora_rank=10,
        rope_head_dim=6, v_head_dim=10, n_experts=4, experts_per_token=2, n_shared_experts=1, expert_mlp_dim=16,
        first_dense_layers=1, scan_layers=False,
    ),
    "deepseek_v2_dense_scanned": config_lib.ModelConfig(  # MLA reads no n_kv_heads: DeepSeek's is n_heads
        **SMALL | dict(n_kv_heads=4), tie_embeddings=False, attention_type="mla", kv_lora_rank=12, rope_head_dim=6, v_head_dim=8,
    ),
}


def _params(cfg: config_lib.ModelConfig, seed: int = 0) -> model_lib.Params:
    """Initialised parameters with the norm scales moved off 1, so a swapped norm shows in the logits."""
    params = model_lib.init_params(model_lib.define(cfg), seed)
    rng = np.random.default_rng(seed)
    flat = jax.tree_util.tree_flatten_with_path(params)

    def perturb(path, x):
        if path[-1].key == "scale":
            return x + 0.3 * rng.standard_normal(x.shape).astype(np.float32)
        return x

    return jax.tree_util.tree_unflatten(flat[1], [perturb(p, x) for p, x in flat[0]])


# --------------------------------------------------------------- the transformers equations in NumPy


def _rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate_half(x):
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def _rope(x, theta):
    """``x`` ``(heads, seq, d)``: ``x cos + rotate_half(x) sin`` with frequencies ``theta^(-2i/d)`` repeated twice."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(x.shape[1])[:, None] * inv_freq[None]
    emb = np.concatenate([angles, angles], axis=-1)
    return x * np.cos(emb) + _rotate_half(x) * np.sin(emb)


def _silu(x):
    return x / (1 + np.exp(-x))


def _mlp(x, w, prefix, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = (w[f"{prefix}.{n}.weight"] for n in names)
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def _attention(x, w, p, c):
    s = x.shape[0]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    q = (x @ w[f"{p}.q_proj.weight"].T).reshape(s, nh, hd).transpose(1, 0, 2)
    k = (x @ w[f"{p}.k_proj.weight"].T).reshape(s, nkv, hd).transpose(1, 0, 2)
    v = (x @ w[f"{p}.v_proj.weight"].T).reshape(s, nkv, hd).transpose(1, 0, 2)
    if c["model_type"] in ("qwen3", "qwen3_moe"):
        q, k = _rms_norm(q, w[f"{p}.q_norm.weight"], c["rms_norm_eps"]), _rms_norm(k, w[f"{p}.k_norm.weight"], c["rms_norm_eps"])
    q, k = _rope(q, c["rope_theta"]), _rope(k, c["rope_theta"])
    k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(s, nh * hd) @ w[f"{p}.o_proj.weight"].T


def _rope_pairs(x, theta):
    """DeepSeek's RoPE: rotates adjacent pairs ``(x_2i, x_2i+1)`` by ``pos theta^(-2i/d)``."""
    d = x.shape[-1]
    angles = np.arange(x.shape[1])[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(angles) - b * np.sin(angles)
    out[..., 1::2] = a * np.sin(angles) + b * np.cos(angles)
    return out


def _causal_attention(q, k, v):
    s = q.shape[1]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


def _deepseek_attention(x, w, p, c):
    s, h, eps = x.shape[0], c["num_attention_heads"], c["rms_norm_eps"]
    dn, dr, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    if c["q_lora_rank"]:
        q = _rms_norm(x @ w[f"{p}.q_a_proj.weight"].T, w[f"{p}.q_a_layernorm.weight"], eps) @ w[f"{p}.q_b_proj.weight"].T
    else:
        q = x @ w[f"{p}.q_proj.weight"].T
    q = q.reshape(s, h, dn + dr).transpose(1, 0, 2)
    compressed = x @ w[f"{p}.kv_a_proj_with_mqa.weight"].T
    kv = _rms_norm(compressed[:, :r], w[f"{p}.kv_a_layernorm.weight"], eps) @ w[f"{p}.kv_b_proj.weight"].T
    kv = kv.reshape(s, h, dn + dv).transpose(1, 0, 2)
    k_pe = np.broadcast_to(_rope_pairs(compressed[None, :, r:], c["rope_theta"]), (h, s, dr))
    q = np.concatenate([q[..., :dn], _rope_pairs(q[..., dn:], c["rope_theta"])], axis=-1)
    k = np.concatenate([kv[..., :dn], k_pe], axis=-1)
    out = _causal_attention(q, k, kv[..., dn:])
    return out.transpose(1, 0, 2).reshape(s, h * dv) @ w[f"{p}.o_proj.weight"].T


def _softmax_top_k_moe(x, w, p, c):
    """DeepSeek-V2's and Qwen3-MoE's MoE: softmax gates of the top k (renormalised with norm_topk_prob), shared experts."""
    logits = x @ w[f"{p}.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = _mlp(x, w, f"{p}.shared_experts") if c.get("n_shared_experts") else np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[: c["num_experts_per_tok"]]
        gates = probs[t, top] / probs[t, top].sum() if c["norm_topk_prob"] else probs[t, top]
        for e, g in zip(top, gates, strict=True):
            out[t] += g * _mlp(x[t], w, f"{p}.experts.{e}")
    return out


def _mixtral_moe(x, w, p, c):
    logits = x @ w[f"{p}.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[: c["num_experts_per_tok"]]
        gates = probs[t, top] / probs[t, top].sum()
        for e, g in zip(top, gates, strict=True):
            out[t] += g * _mlp(x[t], w, f"{p}.experts.{e}", ("w1", "w3", "w2"))
    return out


def reference_logits(directory, tokens: np.ndarray) -> np.ndarray:
    """Logits of one sequence from ``config.json`` and ``model.safetensors`` alone, in float64."""
    c = json.loads((directory / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(directory / "model.safetensors").items()}
    eps = c["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        attention = _deepseek_attention if c["model_type"] == "deepseek_v2" else _attention
        x = x + attention(_rms_norm(x, w[f"{p}.input_layernorm.weight"], eps), w, f"{p}.self_attn", c)
        h = _rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        if c["model_type"] == "mixtral":
            x = x + _mixtral_moe(h, w, f"{p}.block_sparse_moe", c)
        elif c["model_type"] == "deepseek_v2" and i >= c["first_k_dense_replace"]:
            x = x + _softmax_top_k_moe(h, w, f"{p}.mlp", c)
        elif c["model_type"] == "qwen3_moe" and i not in c["mlp_only_layers"] and (i + 1) % c["decoder_sparse_step"] == 0:
            x = x + _softmax_top_k_moe(h, w, f"{p}.mlp", c)
        else:
            x = x + _mlp(h, w, f"{p}.mlp")
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return _rms_norm(x, w["model.norm.weight"], eps) @ head.T


# --------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exported_logits_equal_the_transformers_equations(name, tmp_path):
    cfg = CONFIGS[name]
    params = _params(cfg)
    hf.save(tmp_path, cfg, params)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [hf.architecture(cfg)]
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    ours = np.asarray(model_lib.apply(model_lib.define(cfg), params, jax.numpy.asarray(tokens)))
    for row in range(tokens.shape[0]):
        np.testing.assert_allclose(ours[row], reference_logits(tmp_path, tokens[row]), atol=1e-4, rtol=0)


@pytest.mark.devices(8)
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral", "deepseek_v2"])
def test_round_trip_is_bit_identical_and_lands_in_the_run_shardings(name, tmp_path):
    cfg = CONFIGS[name]
    params = _params(cfg, seed=3)
    hf.save(tmp_path, cfg, params, max_shard_bytes=20_000)  # several files and an index
    assert (tmp_path / hf.INDEX_FILE).is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 2
    mesh = mesh_lib.make_mesh("data:2,fsdp:2,tensor:2")
    rules = rules_lib.make_rules("fsdp")
    model_def, loaded = model_lib.from_hf(tmp_path, mesh, rules)
    assert model_def.config == cfg
    expected = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]  # noqa: E731
    for (path, a), (_, b), (_, s) in zip(flat(params), flat(loaded), flat(expected), strict=True):
        assert b.sharding == s, path
        assert b.dtype == a.dtype and np.array_equal(np.asarray(a), np.asarray(b)), path


def test_a_bfloat16_export_holds_the_rounded_weights(tmp_path):
    cfg = CONFIGS["mixtral"]
    params = _params(cfg)
    hf.save(tmp_path, cfg, params, dtype="bfloat16")
    assert json.loads((tmp_path / hf.CONFIG).read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / hf.SINGLE_FILE).values()} == {np.dtype(jax.numpy.bfloat16)}
    _, loaded = model_lib.from_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32), np.asarray(b))


def test_a_stacked_export_imports_unrolled(tmp_path):
    cfg = CONFIGS["llama"]
    params = _params(cfg)
    hf.save(tmp_path, cfg, params)
    model_def, loaded = model_lib.from_hf(tmp_path, scan_layers=False)
    assert not model_def.config.scan_layers
    for i in range(cfg.n_layers):
        np.testing.assert_array_equal(loaded["blocks"][i]["attn"]["k_proj"]["kernel"], params["blocks"]["attn"]["k_proj"]["kernel"][i])


def test_config_round_trip():
    for cfg in CONFIGS.values():
        back = hf.from_hf_config(hf.to_hf_config(cfg), scan_layers=cfg.scan_layers)
        assert back == cfg


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention_type="mla", n_experts=4, router_score="sigmoid"), "DeepSeek-V2 scores experts with a softmax"),
        (dict(n_experts=4, n_shared_experts=1, expert_mlp_dim=16, normalize_router_weights=True), "shared experts"),
        (dict(n_experts=4, expert_mlp_dim=16), "normalize_router_weights"),
    ],
)
def test_architectures_without_an_equivalent_name_the_difference(changes, message):
    with pytest.raises(hf.UnsupportedArchitecture, match=message):
        hf.architecture(dataclasses.replace(CONFIGS["llama"], **changes))


def test_a_trained_router_bias_refuses_to_export(tmp_path):
    cfg = CONFIGS["mixtral"]
    params = _params(cfg)
    params["blocks"]["mlp"]["router"]["bias"] = params["blocks"]["mlp"]["router"]["bias"] + 0.1
    with pytest.raises(hf.UnsupportedArchitecture, match="router"):
        hf.save(tmp_path, cfg, params)


def test_unsupported_transformers_configs_are_named():
    hf_config = hf.to_hf_config(CONFIGS["llama"])
    with pytest.raises(hf.UnsupportedArchitecture, match="rope_scaling"):
        hf.from_hf_config(hf_config | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(hf.UnsupportedArchitecture, match="GPT2LMHeadModel"):
        hf.from_hf_config(hf_config | {"architectures": ["GPT2LMHeadModel"]})


def test_a_wrong_shape_or_missing_or_extra_tensor_is_named(tmp_path):
    cfg = CONFIGS["llama"]
    hf.save(tmp_path, cfg, _params(cfg))
    tensors = load_file(tmp_path / hf.SINGLE_FILE)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # a buffer: ignored
    save_file(tensors | {"model.layers.0.mlp.extra.weight": np.ones(2, np.float32)}, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointMismatch, match="holds tensor model.layers.0.mlp.extra.weight"):
        model_lib.from_hf(tmp_path)
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    model_lib.from_hf(tmp_path)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointMismatch, match=r"model.layers.1.mlp.up_proj.weight in .* has shape \(47, 32\); .* needs \(48, 32\)"):
        model_lib.from_hf(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointMismatch, match="lacks tensor model.layers.1.mlp.up_proj.weight"):
        model_lib.from_hf(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_itself_gives_our_logits(name, tmp_path):
    """Runs only where torch and transformers are installed (the suite does not need them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    params = _params(cfg)
    hf.save(tmp_path, cfg, params)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        theirs = theirs_model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(model_lib.apply(model_lib.define(cfg), params, jax.numpy.asarray(tokens)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
