"""Hugging Face checkpoints (lm/hf.py): our logits equal an independent NumPy forward pass of the
exported transformers layout, and export -> import gives bit-identical parameters on a mesh."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lm import config as config_lib
from lm import fp8
from lm import hf
from lm import model as model_lib
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib
from tests.lm import rope_reference

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
        **SMALL | dict(n_layers=3, n_kv_heads=4, norm_eps=1e-6), tie_embeddings=False, attention_type="mla", kv_lora_rank=12, q_lora_rank=10,
        rope_head_dim=6, v_head_dim=10, n_experts=4, experts_per_token=2, n_shared_experts=1, expert_mlp_dim=16,
        first_dense_layers=1, scan_layers=False,
    ),
    "deepseek_v2_dense_scanned": config_lib.ModelConfig(  # MLA reads no n_kv_heads: DeepSeek's is n_heads
        **SMALL | dict(n_kv_heads=4, norm_eps=1e-6), tie_embeddings=False, attention_type="mla", kv_lora_rank=12, rope_head_dim=6, v_head_dim=8,
    ),
    "deepseek_v2_yarn": config_lib.ModelConfig(  # DeepSeek-V2's YaRN: frequencies, attention factor and softmax scale
        **SMALL | dict(n_kv_heads=4, norm_eps=1e-6), tie_embeddings=False, attention_type="mla", kv_lora_rank=12, rope_head_dim=6, v_head_dim=8,
        rope_scaling="yarn", rope_factor=8.0, rope_original_max_len=8, rope_mscale=1.0, rope_mscale_all_dim=0.5,
    ),
    "deepseek_v2_groups": config_lib.ModelConfig(  # full DeepSeek-V2's routing: scaled gates, top 2 of 4 expert groups
        **SMALL | dict(n_kv_heads=4, norm_eps=1e-6), tie_embeddings=False, attention_type="mla", kv_lora_rank=12, rope_head_dim=6,
        v_head_dim=8, n_experts=8, experts_per_token=3, expert_mlp_dim=16, router_scale=2.5, router_groups=4, router_topk_groups=2,
    ),
    "llama_llama3": config_lib.ModelConfig(
        **SMALL, rope_theta=5e5, rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=16, rope_high_freq_factor=2.0,
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


def _frequencies(c, dim, seq_len):
    """transformers' inverse frequencies and attention factor for ``config.json`` ``c`` (`rope_reference`)."""
    p = rope_reference.rope_parameters(c)
    return rope_reference.INIT_FUNCTIONS[p["rope_type"]](p, dim, c["max_position_embeddings"], seq_len)


def _rope(x, c):
    """``x`` ``(heads, seq, d)``: ``(x cos + rotate_half(x) sin) a`` with the frequencies repeated twice."""
    inv_freq, factor = _frequencies(c, x.shape[-1], x.shape[1])
    angles = np.arange(x.shape[1])[:, None] * inv_freq[None]
    emb = np.concatenate([angles, angles], axis=-1)
    return (x * np.cos(emb) + _rotate_half(x) * np.sin(emb)) * factor


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
    q, k = _rope(q, c), _rope(k, c)
    k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(s, nh * hd) @ w[f"{p}.o_proj.weight"].T


def _rope_pairs(x, c):
    """DeepSeek's RoPE: rotates adjacent pairs ``(x_2i, x_2i+1)`` by ``pos w_i``, times the attention factor."""
    inv_freq, factor = _frequencies(c, x.shape[-1], x.shape[1])
    angles = np.arange(x.shape[1])[:, None] * inv_freq[None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(angles) - b * np.sin(angles)
    out[..., 1::2] = a * np.sin(angles) + b * np.cos(angles)
    return out * factor


def _causal_attention(q, k, v, scale=1.0):
    s = q.shape[1]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]) * scale
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
    k_pe = np.broadcast_to(_rope_pairs(compressed[None, :, r:], c), (h, s, dr))
    q = np.concatenate([q[..., :dn], _rope_pairs(q[..., dn:], c)], axis=-1)
    k = np.concatenate([kv[..., :dn], k_pe], axis=-1)
    out = _causal_attention(q, k, kv[..., dn:], rope_reference.deepseek_softmax_mscale(rope_reference.rope_parameters(c)))
    return out.transpose(1, 0, 2).reshape(s, h * dv) @ w[f"{p}.o_proj.weight"].T


def _softmax_top_k_moe(x, w, p, c):
    """DeepSeek-V2's and Qwen3-MoE's MoE: softmax gates of the top k (renormalised with norm_topk_prob), shared experts;
    DeepSeek-V2's ``group_limited_greedy`` (only the ``topk_group`` groups with the best expert score, the others' scores
    set to 0) and its gates times ``routed_scaling_factor``."""
    logits = x @ w[f"{p}.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = _mlp(x, w, f"{p}.shared_experts") if c.get("n_shared_experts") else np.zeros_like(x)
    n_group = c["n_group"] if c.get("topk_method") == "group_limited_greedy" else 1
    for t in range(x.shape[0]):
        by_group = probs[t].reshape(n_group, -1)
        kept = np.argsort(-by_group.max(-1))[: c["topk_group"] if n_group > 1 else 1]
        masked = np.where(np.isin(np.arange(n_group), kept)[:, None], by_group, 0.0).reshape(-1)
        top = np.argsort(-masked)[: c["num_experts_per_tok"]]
        gates = probs[t, top] / probs[t, top].sum() if c["norm_topk_prob"] else probs[t, top]
        gates = gates * c.get("routed_scaling_factor", 1.0)
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
    model_def, loaded = hf.load_model(tmp_path, mesh, rules)
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
    written = json.loads((tmp_path / hf.CONFIG).read_text())
    assert written["dtype" if hf.installed_spelling() >= 5 else "torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / hf.SINGLE_FILE).values()} == {np.dtype(jax.numpy.bfloat16)}
    _, loaded = hf.load_model(tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a).astype(jax.numpy.bfloat16).astype(np.float32), np.asarray(b))


def test_an_fp8_model_exports_its_master_weights_and_imports_with_fresh_scaling(tmp_path):
    """``model.fp8``'s scales and amax histories are training state (`lm.fp8`): the export holds the weights of the
    model without FP8, and an FP8 model imports them with its scaling as initialised (were: a ValueError naming
    the scaling leaves, both ways)."""
    cfg, fp8_cfg = CONFIGS["llama"], dataclasses.replace(CONFIGS["llama"], fp8="e4m3", fp8_amax_history=4)
    params = _params(fp8_cfg)
    params["blocks"]["attn"]["k_proj"]["dot_general"]["kernel_scale"] += 2.0  # as a trained run's scaling
    weights, scaling = fp8.split(params)
    assert scaling and jax.tree.structure(weights) == jax.tree.structure(_params(cfg))
    hf.save(tmp_path / "fp8", fp8_cfg, params)
    hf.save(tmp_path / "plain", cfg, weights)
    assert load_file(tmp_path / "fp8" / hf.SINGLE_FILE).keys() == load_file(tmp_path / "plain" / hf.SINGLE_FILE).keys()
    for name, tensor in load_file(tmp_path / "fp8" / hf.SINGLE_FILE).items():
        np.testing.assert_array_equal(tensor, load_file(tmp_path / "plain" / hf.SINGLE_FILE)[name])
    model_def, loaded = hf.load_model(tmp_path / "fp8", fp8="e4m3", fp8_amax_history=4)
    loaded_weights, loaded_scaling = fp8.split(loaded)
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(loaded_weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh = fp8.split(model_lib.init_params(model_def, 0))[1]
    assert jax.tree.structure(loaded_scaling) == jax.tree.structure(fresh)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(loaded_scaling), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stacked_export_imports_unrolled(tmp_path):
    cfg = CONFIGS["llama"]
    params = _params(cfg)
    hf.save(tmp_path, cfg, params)
    model_def, loaded = hf.load_model(tmp_path, scan_layers=False)
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
        (dict(attention_type="mla", n_experts=4, normalize_router_weights=True), "DeepSeek-V2 does not renormalise"),
        (dict(attention_type="mla", norm_eps=1e-5), "latents with eps 1e-06 whatever rms_norm_eps says: set model.norm_eps=1e-06"),
        (dict(n_experts=4, expert_mlp_dim=16, normalize_router_weights=True, router_scale=2.0), "only DeepSeek-V2 scales the gates"),
        (dict(qk_norm=True, n_experts=4, router_groups=2, router_topk_groups=1), "only DeepSeek-V2 routes within groups"),
        (dict(attention_type="lightning", scan_layers=False), "model.attention_type=lightning .linear attention.: transformers' Llama"),
        (dict(mlp_activation="relu2"), "model.mlp_activation=relu2"),
        (dict(logit_softcap=15.0), "model.logit_softcap=15.0"),
        (dict(norm_scale=False), "model.norm_scale=False"),
        (dict(attention_scale=0.12), "model.attention_scale=0.12"),
        (dict(embed_vocab_size=8, tie_embeddings=False), "model.embed_vocab_size=8"),
        (dict(value_embeddings=1, n_kv_heads=4, scan_layers=False), "model.value_embeddings=1"),
        (dict(unet_skips=True, scan_layers=False), "model.unet_skips=True"),
        (dict(x0_mixing=True, scan_layers=False), "model.x0_mixing=True"),
        (dict(skip_attention="1", scan_layers=False), "model.skip_attention='1'"),
        (dict(attention_window=8, window_block=4), "model.attention_window=8"),
    ],
)
def test_architectures_without_an_equivalent_name_the_difference(changes, message):
    with pytest.raises(hf.UnsupportedArchitecture, match=message):
        hf.architecture(dataclasses.replace(CONFIGS["llama"], **changes))


def test_a_refused_export_leaves_the_folders_earlier_export_as_it_was(tmp_path):
    """A soft-capped or windowed model has a Llama's parameters: only the check stops a silent export of
    another function. And a refusal (that one, or parameters that do not fit the config) comes before
    the earlier export's weight files are removed."""
    cfg, params = CONFIGS["llama"], _params(CONFIGS["llama"])
    earlier = {path.name: path.read_bytes() for path in hf.save(tmp_path, cfg, params)}
    capped = dataclasses.replace(cfg, logit_softcap=15.0, attention_window=8, window_block=4)
    with pytest.raises(hf.UnsupportedArchitecture, match=r"model.logit_softcap=15.0, model.attention_window=8"):
        hf.save(tmp_path, capped, params)
    with pytest.raises(ValueError, match="do not match the model config"):
        hf.save(tmp_path, dataclasses.replace(cfg, tie_embeddings=False), params)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == earlier


def test_a_trained_router_bias_refuses_to_export(tmp_path):
    cfg = CONFIGS["mixtral"]
    params = _params(cfg)
    params["blocks"]["mlp"]["router"]["bias"] = params["blocks"]["mlp"]["router"]["bias"] + 0.1
    with pytest.raises(hf.UnsupportedArchitecture, match="router"):
        hf.save(tmp_path, cfg, params)


def test_unsupported_transformers_configs_are_named():
    hf_config = hf.to_hf_config(CONFIGS["llama"])
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    for spelling in ("rope_scaling", "rope_parameters"):
        with pytest.raises(hf.UnsupportedArchitecture, match="rope_type='longrope'"):
            hf.from_hf_config(hf_config | {spelling: longrope})
    with pytest.raises(hf.UnsupportedArchitecture, match="rope_type='llama3' without low_freq_factor, high_freq_factor"):
        hf.from_hf_config(hf_config | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(hf.UnsupportedArchitecture, match="partial_rotary_factor=0.5"):
        hf.from_hf_config(hf_config | {"partial_rotary_factor": 0.5})
    with pytest.raises(hf.UnsupportedArchitecture, match="layer_types"):
        hf.from_hf_config(hf_config | {"layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(hf.UnsupportedArchitecture, match="GPT2LMHeadModel"):
        hf.from_hf_config(hf_config | {"architectures": ["GPT2LMHeadModel"]})


# hand-written config.json files as transformers 4.x and 5 spell them (no torch needed)
_LLAMA_4X = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 32},
}  # fmt: skip
_LLAMA_5 = {k: v for k, v in _LLAMA_4X.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")} | {
    "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}  # fmt: skip


def test_both_spellings_read_alike_and_the_installed_one_is_written():
    old, new = hf.from_hf_config(_LLAMA_4X), hf.from_hf_config(_LLAMA_5)
    assert old == new
    assert (new.rope_theta, new.rope_scaling, new.rope_factor, new.rope_original_max_len, new.max_seq_len) == (5e5, "llama3", 8.0, 32, 128)
    five, four = hf.to_hf_config(new, spelling=5), hf.to_hf_config(new, spelling=4)
    assert five["rope_parameters"] == _LLAMA_5["rope_parameters"] and "rope_theta" not in five and "rope_scaling" not in five
    assert four["rope_theta"] == 5e5 and four["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in four
    assert hf.from_hf_config(five) == hf.from_hf_config(four) == new
    assert hf.to_hf_config(new) == (five if hf.installed_spelling() >= 5 else four)
    # a theta in rope_parameters wins over none at the top level; none anywhere: transformers' default (Mixtral's 1e6)
    plain = {k: v for k, v in _LLAMA_5.items() if k != "rope_parameters"}
    assert hf.from_hf_config(plain | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_theta == 1e6
    assert hf.from_hf_config(plain).rope_theta == 10_000.0
    mixtral = hf.to_hf_config(CONFIGS["mixtral"])
    del mixtral["rope_parameters"]
    assert hf.from_hf_config(mixtral).rope_theta == 1e6


def test_scaling_keys_transformers_fills_in():
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": None, "mscale": 0.707, "mscale_all_dim": 0.707}
    cfg = hf.from_hf_config(_LLAMA_5 | {"rope_parameters": yarn, "original_max_position_embeddings": 16})
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == ("yarn", 8.0, 16)  # factor = 128 / 16
    dynamic = hf.from_hf_config(_LLAMA_5 | {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    assert (dynamic.max_seq_len, dynamic.rope_original_max_len) == (256, 128)  # it runs to factor x the original context
    assert hf.to_hf_config(dynamic, spelling=5)["max_position_embeddings"] == 128
    assert hf.from_hf_config(hf.to_hf_config(dynamic)) == dynamic


def test_moe_configs_in_both_spellings():
    qwen = hf.to_hf_config(CONFIGS["qwen3_moe"], spelling=5)
    assert qwen["num_local_experts"] == 4 and "num_experts" not in qwen
    old = {k: v for k, v in qwen.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert hf.from_hf_config(old, scan_layers=False) == hf.from_hf_config(qwen, scan_layers=False) == CONFIGS["qwen3_moe"]
    for normalised in (True, False):
        assert hf.from_hf_config(qwen | {"norm_topk_prob": normalised}).normalize_router_weights == normalised
    deepseek = hf.to_hf_config(CONFIGS["deepseek_v2"])
    assert deepseek["norm_topk_prob"] is False
    assert not hf.from_hf_config(deepseek | {"norm_topk_prob": True}).normalize_router_weights  # transformers ignores it
    every_group = deepseek | {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 2}
    assert hf.from_hf_config(every_group, scan_layers=False) == CONFIGS["deepseek_v2"]  # greedy: no groups
    limited = hf.from_hf_config(every_group | {"topk_group": 1, "num_experts_per_tok": 2, "routed_scaling_factor": 16})
    assert (limited.router_groups, limited.router_topk_groups, limited.router_scale) == (2, 1, 16.0)
    with pytest.raises(hf.UnsupportedArchitecture, match="experts_per_token=3 exceeds the 2 experts"):
        hf.from_hf_config(every_group | {"topk_group": 1, "num_experts_per_tok": 3})
    with pytest.raises(hf.UnsupportedArchitecture, match="routed_scaling_factor=None"):
        hf.from_hf_config(deepseek | {"routed_scaling_factor": None})
    with pytest.raises(hf.UnsupportedArchitecture, match="topk_method='noaux_tc'"):
        hf.from_hf_config(deepseek | {"topk_method": "noaux_tc"})
    with pytest.raises(hf.UnsupportedArchitecture, match=r"group_limited_greedy' needs n_group .* got n_group=None"):
        hf.from_hf_config(every_group | {"n_group": None})
    with pytest.raises(hf.UnsupportedArchitecture, match="has no 'num_experts_per_tok' \\(or it is null\\)"):
        hf.from_hf_config(deepseek | {"num_experts_per_tok": None})


def test_unreadable_files_are_named_with_the_fix(tmp_path):
    cfg = CONFIGS["llama"]
    hf.save(tmp_path / "one", cfg, _params(cfg))
    files = hf.save(tmp_path / "sharded", cfg, _params(cfg), max_shard_bytes=20_000)
    single = tmp_path / "one" / hf.SINGLE_FILE
    single.write_bytes(single.read_bytes()[:-100])
    with pytest.raises(hf.UnreadableCheckpoint, match=rf"{single} is not a readable safetensors file .*incomplete.* copy the checkpoint again"):
        hf.load_model(tmp_path / "one")
    (tmp_path / "one" / hf.CONFIG).write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(hf.UnreadableCheckpoint, match=rf"{tmp_path / 'one' / hf.CONFIG} is not readable JSON"):
        hf.read_config(tmp_path / "one")
    files[1].unlink()
    with pytest.raises(hf.UnreadableCheckpoint, match=rf"shard {files[1]} named in {hf.INDEX_FILE} does not exist"):
        hf.load_model(tmp_path / "sharded")
    (tmp_path / "sharded" / hf.INDEX_FILE).write_text("[]")
    with pytest.raises(hf.UnreadableCheckpoint, match="holds a JSON list, not an object"):
        hf.load_model(tmp_path / "sharded")


def test_a_wrong_shape_or_missing_or_extra_tensor_is_named(tmp_path):
    cfg = CONFIGS["llama"]
    hf.save(tmp_path, cfg, _params(cfg))
    tensors = load_file(tmp_path / hf.SINGLE_FILE)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # a buffer: ignored
    save_file(tensors | {"model.layers.0.mlp.extra.weight": np.ones(2, np.float32)}, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointMismatch, match="holds tensor model.layers.0.mlp.extra.weight"):
        hf.load_model(tmp_path)
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    hf.load_model(tmp_path)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointMismatch, match=r"model.layers.1.mlp.up_proj.weight in .* has shape \(47, 32\); .* needs \(48, 32\)"):
        hf.load_model(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / hf.SINGLE_FILE)
    with pytest.raises(hf.CheckpointMismatch, match="lacks tensor model.layers.1.mlp.up_proj.weight"):
        hf.load_model(tmp_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_itself_gives_our_logits(name, tmp_path):
    """Runs only where torch and transformers are installed (the suite does not need them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    params = _params(cfg)
    hf.save(tmp_path, cfg, params)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        theirs = theirs_model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(model_lib.apply(model_lib.define(cfg), params, jax.numpy.asarray(tokens)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


# --------------------------------------------------------------- checkpoints transformers itself writes

_TINY = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
    max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
_MLA = dict(num_key_value_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=12, q_lora_rank=10, rms_norm_eps=1e-6)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1)
_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
# name -> (config class, its arguments); every theta differs from 10000 unless the case is about the scaling
TRANSFORMERS_CASES = {
    "llama_theta": ("LlamaConfig", dict(head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=500_000.0))),
    "llama_llama3": ("LlamaConfig", dict(head_dim=8, rope_parameters=_LLAMA3 | dict(rope_theta=500_000.0))),
    "llama_linear": ("LlamaConfig", dict(head_dim=8, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e4))),
    "llama_dynamic": ("LlamaConfig", dict(head_dim=8, max_position_embeddings=8, rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4))),
    "qwen3_theta": ("Qwen3Config", dict(head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3_yarn": ("Qwen3Config", dict(head_dim=8, rope_parameters=_YARN | dict(rope_theta=1e6))),
    "mixtral_default_theta": ("MixtralConfig", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe_normalised": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, norm_topk_prob=True, mlp_only_layers=[0], **_MOE)),
    "qwen3_moe_unnormalised": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, norm_topk_prob=False, rope_parameters=dict(rope_type="default", rope_theta=1e6), **_MOE)),
    "deepseek_v2_theta": ("DeepseekV2Config", dict(**_MLA, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True, rope_parameters=dict(rope_type="default", rope_theta=5e5), **_MOE)),
    "deepseek_v2_groups": ("DeepseekV2Config", dict(**_MLA, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0, num_experts_per_tok=3, moe_intermediate_size=16)),
    "deepseek_v2_yarn": ("DeepseekV2Config", dict(**_MLA, first_k_dense_replace=2, rope_parameters=_YARN | dict(rope_theta=1e4, mscale=0.707, mscale_all_dim=0.707))),
    "deepseek_v2_yarn_mscales": ("DeepseekV2Config", dict(**_MLA, first_k_dense_replace=2, rope_parameters=_YARN | dict(rope_theta=1e4, mscale=1.0, mscale_all_dim=0.5))),
}  # fmt: skip


def _transformers_checkpoint(directory, name, *, dtype="float32", max_shard_size=None):
    """A random model of case ``name`` built by transformers itself and written with ``save_pretrained``; returns it (float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    class_name, kwargs = TRANSFORMERS_CASES[name]
    config = getattr(transformers, class_name)(**_TINY | kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # every weight random (routers included, variance kept through each matrix), norm scales off 1
        for param_name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in param_name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()  # its buffers in float32


def _transformers_logits(model, tokens, incremental=False):
    """Logits of transformers' ``model``: one forward, or (``incremental``) a prefill of half then one token at a time."""
    import torch

    tokens = torch.tensor(tokens)
    with torch.no_grad():
        if not incremental:
            return model(tokens).logits.numpy()
        half = tokens.shape[1] // 2
        out = model(tokens[:, :half], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(half, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
        return torch.cat(logits, dim=1).numpy()


def _our_decode_logits(model_def, params, tokens):
    """Our logits through the KV cache, in the same steps as `_transformers_logits` ``incremental``."""
    from lm import kv_cache

    tokens = jax.numpy.asarray(tokens)
    half = tokens.shape[1] // 2
    cache = kv_cache.init(model_def.config, tokens.shape[0], tokens.shape[1])
    logits, cache = model_lib.decode(model_def, params, tokens[:, :half], cache, jax.numpy.int32(0))
    out = [logits]
    for t in range(half, tokens.shape[1]):
        logits, cache = model_lib.decode(model_def, params, tokens[:, t : t + 1], cache, jax.numpy.int32(t))
        out.append(logits)
    return np.concatenate([np.asarray(o) for o in out], axis=1)


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_CASES))
def test_checkpoints_transformers_writes_give_its_logits(name, tmp_path):
    """Runs only where torch and transformers are installed: transformers' config classes and ``save_pretrained``."""
    theirs_model = _transformers_checkpoint(tmp_path, name)
    model_def, params = hf.load_model(tmp_path)
    tokens = np.random.default_rng(2).integers(0, 64, (2, 12))
    ours = np.asarray(model_lib.apply(model_def, params, jax.numpy.asarray(tokens)))
    theirs = _transformers_logits(theirs_model, tokens)
    print(f"\n{name}: forward max |ours - transformers| = {np.max(np.abs(ours - theirs)):.2e} (max |logit| {np.max(np.abs(theirs)):.1f})")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    if model_def.config.rope_scaling != "none":  # the scaled RoPE at every position of the KV cache too
        ours_decode = _our_decode_logits(model_def, params, tokens)
        theirs_decode = _transformers_logits(theirs_model, tokens, incremental=True)
        print(f"{name}: decode max |ours - transformers| = {np.max(np.abs(ours_decode - theirs_decode)):.2e}")
        np.testing.assert_allclose(ours_decode, theirs_decode, atol=1e-4, rtol=0)
    hf.save(tmp_path / "again", model_def.config, params)  # and back: transformers reads our export as its own
    again = type(theirs_model).from_pretrained(tmp_path / "again").eval()
    np.testing.assert_allclose(_transformers_logits(again, tokens), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype, shard", [("bfloat16", None), ("float32", "20KB")])
def test_bfloat16_and_sharded_files_transformers_writes_import(dtype, shard, tmp_path):
    theirs_model = _transformers_checkpoint(tmp_path, "qwen3_moe_normalised", dtype=dtype, max_shard_size=shard)
    assert (tmp_path / hf.INDEX_FILE).is_file() == (shard is not None)
    model_def, params = hf.load_model(tmp_path)
    tokens = np.random.default_rng(3).integers(0, 64, (2, 12))
    ours = np.asarray(model_lib.apply(model_def, params, jax.numpy.asarray(tokens)))
    theirs = _transformers_logits(theirs_model, tokens)  # the bf16 weights, upcast, in float32
    print(f"\n{dtype} {shard}: max |ours - transformers| = {np.max(np.abs(ours - theirs)):.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


# the keys of DeepSeek-V2-Lite's published config.json (transformers 4.x spelling, YaRN in rope_scaling)
_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip


def test_a_deepseek_config_without_n_shared_experts_is_refused_with_the_fix():
    """transformers 5 and 4.x read a missing ``n_shared_experts`` as 2 and as none: no guess is safe."""
    missing = {k: v for k, v in _V2_LITE.items() if k != "n_shared_experts"}
    with pytest.raises(hf.UnsupportedArchitecture, match="no 'n_shared_experts'.*0 for none"):
        hf.from_hf_config(missing)
    assert hf.from_hf_config(missing | {"n_shared_experts": None}).n_shared_experts == 0


def test_a_released_deepseek_v2_config_imports_with_its_yarn():
    from lm import rope

    cfg = hf.from_hf_config(_V2_LITE)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len, cfg.max_seq_len) == ("yarn", 40.0, 4096, 163840)
    assert (cfg.rope_mscale, cfg.rope_mscale_all_dim, cfg.n_experts, cfg.first_dense_layers) == (0.707, 0.707, 64, 1)
    assert rope.attention_factor(cfg) == 1.0  # m(40, 0.707) / m(40, 0.707)
    assert rope.softmax_scale_factor(cfg) == pytest.approx((0.1 * 0.707 * np.log(40) + 1) ** 2)
    assert hf.from_hf_config(hf.to_hf_config(cfg, spelling=5), scan_layers=False) == cfg
    # DeepSeek-V2 (full): 160 routed experts top-6 from the best 3 of 8 groups, gates times 16
    full = _V2_LITE | {"n_routed_experts": 160, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
                       "routed_scaling_factor": 16.0}  # fmt: skip
    cfg = hf.from_hf_config(full)
    assert (cfg.n_experts, cfg.router_groups, cfg.router_topk_groups, cfg.router_scale, cfg.routable_experts) == (160, 8, 3, 16.0, 60)
    written = hf.to_hf_config(cfg)
    assert {k: written[k] for k in ("topk_method", "n_group", "topk_group", "routed_scaling_factor")} == {
        k: full[k] for k in ("topk_method", "n_group", "topk_group", "routed_scaling_factor")
    }
    assert hf.from_hf_config(written, scan_layers=False) == cfg
