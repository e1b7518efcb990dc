"""Hugging Face transformers checkpoints: our parameter tree and `ModelConfig` in their names and layouts.

Each of our parameter leaves maps to one or more transformers tensors (`Source`):

- a kernel ``(fan_in, fan_out)`` is a ``Linear.weight`` ``(out, in)``: the transpose;
- under ``scan_layers`` a block leaf carries a leading ``layers`` axis; layer ``i`` is ``model.layers.{i}``;
- an MoE expert stack ``(experts, in, out)`` is one tensor per expert;
- tied embeddings have no ``lm_head.weight`` (``tie_word_embeddings``).

The architecture follows from the config (`architecture`): Llama for dense grouped-query attention,
Qwen3 when QK-norm is on (``self_attn.{q,k}_norm``), Qwen3-MoE for QK-norm with routed experts
(``mlp.gate``, ``mlp.experts.{j}.*_proj``; ``decoder_sparse_step`` is our ``moe_every``), Mixtral for a
routed MoE in every block without shared experts or QK-norm (``block_sparse_moe.gate``,
``experts.{j}.w1`` gate / ``w3`` up / ``w2`` down),
DeepSeek-V2 for multi-head latent attention, dense or MoE (``mlp.gate``, ``mlp.experts.{j}.*_proj``,
``mlp.shared_experts``, dense blocks before ``first_k_dense_replace``). Llama, Qwen3 and Mixtral
rotate halves in RoPE (pairs ``(x_i, x_{i + d/2})``, transformers' ``rotate_half``) as we do, so
their query and key rows keep their order; DeepSeek-V2 rotates adjacent pairs ``(x_{2i}, x_{2i+1})``,
so the RoPE rows of its query and key projections are permuted (`_interleaved`). Its
``kv_a_proj_with_mqa`` and ``kv_b_proj`` each hold two of our leaves (`Source.rows`). Anything else
has no transformers equivalent here and is an `UnsupportedArchitecture` naming the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm import fp8 as fp8_lib
from lm import model as model_lib
from lm import rope
from lm.config import ModelConfig
from sharding import partition
from sharding import rules as rules_lib

Params = dict[str, Any]
Path_ = tuple[Any, ...]  # a leaf's keys in the parameter dict, e.g. ("blocks", "attn", "q_proj", "kernel")

CONFIG = "config.json"
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# The ModelConfig fields a transformers config.json decides (the rest say how to compute, not what).
CONFIG_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "max_seq_len", "rope_theta",
    "norm_eps", "tie_embeddings", "qk_norm", "attention_type", "n_experts", "experts_per_token", "n_shared_experts",
    "moe_every", "first_dense_layers", "expert_mlp_dim", "router_score", "normalize_router_weights", "router_scale",
    "router_groups", "router_topk_groups", "kv_lora_rank",
    "q_lora_rank", "rope_head_dim", "v_head_dim", "rope_scaling", "rope_factor", "rope_original_max_len",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim",
    "rope_attention_factor", "rope_truncate",
)  # fmt: skip

_BUFFERS = ("rotary_emb.inv_freq",)  # saved by older transformers versions; recomputed, not parameters
_LLAMA, _QWEN3, _QWEN3_MOE = "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
_MIXTRAL, _DEEPSEEK = "MixtralForCausalLM", "DeepseekV2ForCausalLM"
_MODEL_TYPES = {_LLAMA: "llama", _QWEN3: "qwen3", _QWEN3_MOE: "qwen3_moe", _MIXTRAL: "mixtral", _DEEPSEEK: "deepseek_v2"}
_DEEPSEEK_LATENT_EPS = 1e-6  # its q_a_layernorm / kv_a_layernorm take no eps from the config
_DEFAULT_THETA = {_MIXTRAL: 1_000_000.0}  # transformers' default when a config.json names none; else 10000
# transformers' rope_type -> ours; the keys each reads besides rope_type and rope_theta (modeling_rope_utils.py)
_ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic", "llama3": "llama3", "yarn": "yarn"}
_ROPE_KEYS = {
    "none": (), "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}  # fmt: skip
# our field of each transformers rope key
_ROPE_FIELDS = {
    "factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_len",
    "low_freq_factor": "rope_low_freq_factor", "high_freq_factor": "rope_high_freq_factor", "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow", "mscale": "rope_mscale", "mscale_all_dim": "rope_mscale_all_dim",
    "attention_factor": "rope_attention_factor", "truncate": "rope_truncate",
}  # fmt: skip


class CheckpointError(ValueError):
    """A transformers checkpoint that cannot be used; the message names the file and the fix (entry points: exit 2)."""


class UnsupportedArchitecture(CheckpointError):
    """A model (or a transformers config) that has no equivalent on the other side."""


class CheckpointMismatch(CheckpointError):
    """A transformers checkpoint whose tensors do not fit the model (a name or shape differs)."""


class UnreadableCheckpoint(CheckpointError):
    """A file of the checkpoint is missing, truncated or not what its name says (malformed JSON, bad safetensors)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of our leaves lives in a transformers checkpoint.

    Attributes:
      names: the tensor names, an array shaped like the leaf's stacked leading axes (``layers`` under
        ``scan_layers``, then ``experts``); 0-d for an unstacked leaf.
      transpose: each tensor is the transpose of the leaf's trailing matrix (a Linear weight).
      rows: None, or row ``k`` of the leaf's matrix (transposed where ``transpose``) is row ``rows[k]``
        of each tensor: a tensor shared by several leaves, or rows in another order.
    """

    names: np.ndarray
    transpose: bool
    rows: np.ndarray | None = None

    def oriented_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the leaf's part of one tensor, in the tensor's orientation."""
        inner = leaf_shape[self.names.ndim :]
        return inner[::-1] if self.transpose else inner


# ------------------------------------------------------------------------------------ architecture


def _limits_groups(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` routes within fewer than all of its expert groups (DeepSeek-V2's ``group_limited_greedy``)."""
    return 0 < cfg.router_topk_groups < cfg.router_groups


def _deepseek_only_routing(cfg: ModelConfig) -> list[str]:
    """``cfg``'s router settings that only transformers' DeepSeek-V2 computes (Mixtral and Qwen3-MoE lack them)."""
    differences = []
    if cfg.router_scale != 1.0:
        differences.append(f"model.router_scale={cfg.router_scale} (only DeepSeek-V2 scales the gates): set it to 1.0")
    if _limits_groups(cfg):
        differences.append(
            f"model.router_topk_groups={cfg.router_topk_groups} < model.router_groups={cfg.router_groups} "
            "(only DeepSeek-V2 routes within groups): set model.router_topk_groups=0"
        )
    return differences


def _computed_here_only(cfg: ModelConfig) -> list[str]:
    """``cfg``'s options that none of the exported architectures computes: an export would drop them and
    transformers would compute another function (some change no parameter, so nothing else would notice)."""
    options = {
        "model.attention_type=lightning (linear attention)": cfg.attention_type == "lightning",
        f"model.mlp_activation={cfg.mlp_activation} (every exported MLP is SwiGLU)": cfg.mlp_activation != "swiglu",
        f"model.logit_softcap={cfg.logit_softcap}": cfg.logit_softcap > 0,
        "model.norm_scale=False": not cfg.norm_scale,
        f"model.attention_scale={cfg.attention_scale} (transformers scales by 1/sqrt(head_dim))": cfg.attention_scale != 0,
        f"model.embed_vocab_size={cfg.embed_vocab_size} (an embedding narrower than the head)": cfg.embed_vocab_size != 0,
        f"model.value_embeddings={cfg.value_embeddings}": cfg.value_embeddings != 0,
        "model.unet_skips=True": cfg.unet_skips,
        "model.x0_mixing=True": cfg.x0_mixing,
        f"model.skip_attention={cfg.skip_attention!r}": bool(cfg.skip_attention),
        f"model.attention_window={cfg.attention_window} (block sliding windows)": cfg.attention_window != 0,
    }
    return [option for option, is_set in options.items() if is_set]


def architecture(cfg: ModelConfig) -> str:
    """The transformers architecture of ``cfg`` (``LlamaForCausalLM``, ...); raises where there is none."""
    if cfg.parscale > 1:
        raise UnsupportedArchitecture(
            f"model.parscale={cfg.parscale}: transformers has no ParScale architecture (the authors' Qwen2ParScale is "
            "remote code) and a Llama / Qwen3 export would drop the prefixes and the aggregation; set model.parscale=1"
        )
    if unsupported := _computed_here_only(cfg):
        raise UnsupportedArchitecture(
            f"{', '.join(unsupported)}: transformers' Llama, Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V2 compute none of "
            "these, so their checkpoint of this model would compute another function (a model with them neither exports "
            "nor starts from a transformers checkpoint)"
        )
    if cfg.attention_type == "mla":
        return _deepseek_architecture(cfg)
    if not cfg.n_experts:
        return _QWEN3 if cfg.qk_norm else _LLAMA
    if cfg.qk_norm:
        return _qwen3_moe_architecture(cfg)
    differences = _deepseek_only_routing(cfg)
    if cfg.n_shared_experts:
        differences.append(f"model.n_shared_experts={cfg.n_shared_experts} (Mixtral has no shared experts)")
    if cfg.router_score != "softmax" or not cfg.normalize_router_weights:
        differences.append(
            "Mixtral gates with a softmax renormalised over the top-k experts: set model.router_score=softmax and "
            "model.normalize_router_weights=True"
        )
    if cfg.moe_every != 1 or cfg.first_dense_layers:
        differences.append("every Mixtral block is MoE: set model.moe_every=1 and model.first_dense_layers=0")
    if differences:
        raise UnsupportedArchitecture(f"this MoE model has no transformers equivalent: {'; '.join(differences)}")
    return _MIXTRAL


def _qwen3_moe_architecture(cfg: ModelConfig) -> str:
    differences = _deepseek_only_routing(cfg)
    if cfg.n_shared_experts:
        differences.append(f"model.n_shared_experts={cfg.n_shared_experts} (Qwen3-MoE has no shared experts)")
    if cfg.router_score != "softmax":
        differences.append("Qwen3-MoE scores experts with a softmax: set model.router_score=softmax")
    if differences:
        raise UnsupportedArchitecture(f"this QK-norm MoE model has no transformers equivalent: {'; '.join(differences)}")
    return _QWEN3_MOE


def _deepseek_architecture(cfg: ModelConfig) -> str:
    differences = []
    if cfg.n_experts and cfg.router_score != "softmax":
        differences.append("DeepSeek-V2 scores experts with a softmax: set model.router_score=softmax")
    if cfg.n_experts and cfg.moe_every != 1:
        differences.append("DeepSeek-V2 places MoE blocks by first_k_dense_replace only: set model.moe_every=1")
    if cfg.norm_eps != _DEEPSEEK_LATENT_EPS:
        differences.append(
            f"transformers' DeepSeek-V2 normalises its query and KV latents with eps {_DEEPSEEK_LATENT_EPS} whatever "
            f"rms_norm_eps says: set model.norm_eps={_DEEPSEEK_LATENT_EPS}"
        )
    if cfg.n_experts and cfg.normalize_router_weights:
        differences.append(
            "transformers' DeepSeek-V2 does not renormalise the top-k gates (it ignores norm_topk_prob): "
            "set model.normalize_router_weights=False"
        )
    if differences:
        raise UnsupportedArchitecture(f"this MLA model has no transformers equivalent: {'; '.join(differences)}")
    return _DEEPSEEK


def installed_spelling() -> int:
    """The major version of the installed transformers (4 or 5), whose ``config.json`` spelling `to_hf_config` writes;
    5 when none is installed.

    transformers 5 writes ``rope_theta`` and the scaling inside ``rope_parameters``, Qwen3-MoE's expert count as
    ``num_local_experts`` and the weight dtype as ``dtype``; 4.x writes top-level ``rope_theta`` / ``rope_scaling``,
    ``num_experts`` and ``torch_dtype``. 5 reads both; 4.x only its own.
    """
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return 5
    return 4 if int(version.split(".")[0]) < 5 else 5


def _rope_config(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg``'s RoPE as transformers' ``rope_parameters`` (``rope_type``, ``rope_theta`` and the type's keys)."""
    kind = next(theirs for theirs, ours in _ROPE_TYPES.items() if ours == cfg.rope_scaling)
    out: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    for key in _ROPE_KEYS[cfg.rope_scaling]:
        value = getattr(cfg, _ROPE_FIELDS[key])
        if key == "original_max_position_embeddings":
            value = rope.original_context(cfg)
        if key in ("mscale", "mscale_all_dim", "attention_factor") and not value:
            continue  # unset
        out[key] = value
    return out


def to_hf_config(cfg: ModelConfig, dtype: str = "float32", spelling: int | None = None) -> dict[str, Any]:
    """The transformers ``config.json`` of ``cfg`` with weights in ``dtype``, in the ``spelling`` of transformers 4 or 5
    (default: `installed_spelling`)."""
    arch = architecture(cfg)
    spelling = spelling or installed_spelling()
    rope_config = _rope_config(cfg)
    out = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        # dynamic NTK scales beyond max_position_embeddings, which is then the original context
        "max_position_embeddings": rope.original_context(cfg) if cfg.rope_scaling == "dynamic" else cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    if spelling >= 5:
        out |= {"rope_parameters": rope_config, "dtype": dtype}
    else:
        theta = rope_config.pop("rope_theta")
        out |= {"rope_theta": theta, "rope_scaling": rope_config if cfg.rope_scaling != "none" else None, "torch_dtype": dtype}
    if arch == _LLAMA:
        out["mlp_bias"] = False
    if arch in (_QWEN3, _QWEN3_MOE):
        out |= {"use_sliding_window": False, "sliding_window": None}
    if arch == _QWEN3_MOE:
        out |= {
            "num_local_experts" if spelling >= 5 else "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.expert_mlp_dim or cfg.mlp_dim,
            "norm_topk_prob": cfg.normalize_router_weights,
            "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": list(range(cfg.first_dense_layers)),
        }
    if arch == _MIXTRAL:
        out |= {
            "intermediate_size": cfg.expert_mlp_dim or cfg.mlp_dim,
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "sliding_window": None,
        }
    if arch == _DEEPSEEK:
        del out["head_dim"]
        moe = cfg.n_experts > 0
        out |= {
            "num_key_value_heads": cfg.n_heads,
            "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank or None,
            "qk_nope_head_dim": cfg.head_dim,
            "qk_rope_head_dim": cfg.rope_head_dim,
            "v_head_dim": cfg.value_head_dim,
            "moe_intermediate_size": cfg.expert_mlp_dim or cfg.mlp_dim,
            "first_k_dense_replace": cfg.first_dense_layers if moe else cfg.n_layers,
            "moe_layer_freq": 1,
            "norm_topk_prob": False,  # transformers ignores it: its DeepSeek-V2 never renormalises (`architecture` refuses)
            "routed_scaling_factor": cfg.router_scale,
            "scoring_func": "softmax",
            "topk_method": "group_limited_greedy" if _limits_groups(cfg) else "greedy",
            "n_group": cfg.router_groups if _limits_groups(cfg) else 1,
            "topk_group": cfg.router_topk_groups if _limits_groups(cfg) else 1,
        }
        if moe:  # a dense model says so by first_k_dense_replace alone (transformers wants ints here)
            out |= {
                "n_routed_experts": cfg.n_experts,
                "n_shared_experts": cfg.n_shared_experts or (0 if spelling >= 5 else None),  # 5 wants an int, 4.x None
                "num_experts_per_tok": cfg.experts_per_token,
            }
    return out


def _require(hf: dict[str, Any], key: str, where: str) -> Any:
    if hf.get(key) is None:
        raise UnsupportedArchitecture(f"{where} has no {key!r} (or it is null); is it a complete transformers config.json?")
    return hf[key]


def from_hf_config(hf: dict[str, Any], where: str = CONFIG, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a transformers ``config.json`` (``hf``), with ``overrides`` (``dtype``, ``scan_layers``, ...).

    Raises:
      UnsupportedArchitecture: an architecture other than Llama / Qwen3 / Qwen3-MoE / Mixtral / DeepSeek-V2, or a setting our
        model does not compute (a RoPE scaling other than linear / dynamic / llama3 / yarn, biases, sliding windows,
        another activation, DeepSeek-V3's ``noaux_tc`` routing), named.

    Both spellings transformers has written are read (`installed_spelling`); where a key is absent the value is
    transformers' default for the architecture. Router normalisation is what transformers computes: Mixtral always
    renormalises the top-k gates, Qwen3-MoE by ``norm_topk_prob``, DeepSeek-V2 never (it ignores the key); DeepSeek-V2's
``routed_scaling_factor`` and ``group_limited_greedy`` (``n_group``, ``topk_group``) become ``model.router_scale``,
``router_groups`` and ``router_topk_groups`` (groups are dropped where ``topk_group >= n_group``: that routes greedily).
    """
    if "architectures" not in hf and {"model", "optimizer"} <= hf.keys():
        raise CheckpointError(
            f"{where} is a training run's config, not a transformers checkpoint's: export the run first "
            "(python -m experiments.export_hf --workdir=RUN --out=DIR), or pass the run itself as --workdir"
        )
    archs = _require(hf, "architectures", where)
    arch = archs[0] if isinstance(archs, list) and archs else archs
    if arch not in _MODEL_TYPES:
        raise UnsupportedArchitecture(f"{where}: architecture {arch!r} does not convert; supported: {', '.join(_MODEL_TYPES)}")
    problems = []
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (our projections have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (our MLP is SwiGLU)")
    if hf.get("sliding_window") and (arch == _MIXTRAL or hf.get("use_sliding_window")):
        problems.append(f"sliding_window={hf['sliding_window']} (our attention is full causal)")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or ()):
        problems.append(f"layer_types={sorted(set(hf['layer_types']))} (our attention is full causal in every block)")
    rope_fields = _rope_fields(hf, arch, problems)
    if problems:
        raise UnsupportedArchitecture(f"{where} describes a model ours does not compute: {'; '.join(problems)}")
    n_heads = _require(hf, "num_attention_heads", where)
    d_model = _require(hf, "hidden_size", where)
    fields = dict(
        vocab_size=_require(hf, "vocab_size", where),
        d_model=d_model,
        n_layers=_require(hf, "num_hidden_layers", where),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or d_model // n_heads,
        mlp_dim=_require(hf, "intermediate_size", where),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch in (_QWEN3, _QWEN3_MOE),
    ) | rope_fields
    if arch == _MIXTRAL:
        fields |= dict(
            n_experts=_require(hf, "num_local_experts", where),
            experts_per_token=_require(hf, "num_experts_per_tok", where),
            expert_mlp_dim=fields["mlp_dim"],
            normalize_router_weights=True,
        )
    if arch == _DEEPSEEK:
        fields |= _deepseek_fields(hf, where)
    if arch == _QWEN3_MOE:
        fields |= _qwen3_moe_fields(hf, where)
    try:
        cfg = ModelConfig(**(fields | overrides))
        architecture(cfg)  # an override it does not compute (a soft-cap, a window) would make it another model
    except ValueError as e:
        raise UnsupportedArchitecture(f"{where}: {e}") from e
    return cfg


def _rope_fields(hf: dict[str, Any], arch: str, problems: list[str]) -> dict[str, Any]:
    """Our RoPE fields of a ``config.json`` in either spelling: transformers 5's ``rope_parameters`` (``rope_theta`` inside),
    or 4.x's top-level ``rope_theta`` and ``rope_scaling`` (which wins where both are present, as in transformers).
    A scaling other than `_ROPE_TYPES` is appended to ``problems``, named."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        problems.append(f"rope_parameters={params!r} (ours: one RoPE for every block)")
        return {}
    theta = params.get("rope_theta", hf.get("rope_theta") or _DEFAULT_THETA.get(arch, 10_000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} (ours rotates the whole head)")
    if kind not in _ROPE_TYPES:
        problems.append(f"RoPE scaling rope_type={kind!r} (ours: {', '.join(_ROPE_TYPES)})")
        return out
    ours = out["rope_scaling"] = _ROPE_TYPES[kind]
    max_len = hf.get("max_position_embeddings", 2048)
    if ours in ("llama3", "yarn"):  # transformers: a top-level value first, then max_position_embeddings
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_len
        params = params | {"original_max_position_embeddings": original}
        if ours == "yarn" and params.get("factor") is None:
            params["factor"] = max_len / original
    if ours == "dynamic":  # it extends max_position_embeddings by `factor`: run to that length
        out |= {"rope_original_max_len": max_len, "max_seq_len": int(max_len * params.get("factor", 1))}
    if arch == _DEEPSEEK and ours != "yarn" and params.get("mscale_all_dim"):  # transformers would scale the softmax
        problems.append(f"mscale_all_dim with rope_type={kind!r} (ours: with yarn only)")
    missing = [key for key in _ROPE_KEYS[ours] if key in ("factor", "low_freq_factor", "high_freq_factor") and params.get(key) is None]
    if missing:
        problems.append(f"rope_type={kind!r} without {', '.join(missing)}")
    for key in _ROPE_KEYS[ours]:
        if params.get(key) is not None:
            value = params[key]
            out[_ROPE_FIELDS[key]] = bool(value) if key == "truncate" else int(value) if key.startswith("original") else float(value)
    return out


def _qwen3_moe_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE ``config.json``: block ``i`` is MoE when ``(i + 1) % decoder_sparse_step == 0``
    and ``i`` is not in ``mlp_only_layers``, which must be the first blocks (our ``first_dense_layers``)."""
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise UnsupportedArchitecture(f"{where}: mlp_only_layers={dense} (ours: dense blocks only at the start)")
    moe_every = hf.get("decoder_sparse_step", 1)
    return dict(
        n_experts=hf.get("num_experts") or _require(hf, "num_local_experts", where),  # 4.x's name, 5's
        experts_per_token=_require(hf, "num_experts_per_tok", where),
        expert_mlp_dim=_require(hf, "moe_intermediate_size", where),
        normalize_router_weights=bool(hf.get("norm_topk_prob", False)),
        moe_every=moe_every,
        first_dense_layers=len(dense),
        scan_layers=moe_every == 1 and not dense,
    )


def _shared_experts(hf: dict[str, Any], where: str) -> int:
    """DeepSeek-V2's ``n_shared_experts``, which must be written: transformers 5 reads a missing key as 2 and 4.x as
    none, so a config without it means two different models (null or 0 is none in both)."""
    if "n_shared_experts" not in hf:
        raise UnsupportedArchitecture(
            f"{where} has no 'n_shared_experts': transformers 5 reads that as 2 shared experts, 4.x as none; "
            "write the number the checkpoint holds (0 for none) into the config"
        )
    return hf["n_shared_experts"] or 0


def _deepseek_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The MLA and MoE fields of a DeepSeek-V2 ``config.json``."""
    if (eps := hf.get("rms_norm_eps", 1e-6)) != _DEEPSEEK_LATENT_EPS:
        raise UnsupportedArchitecture(
            f"{where}: rms_norm_eps={eps}, but transformers' DeepSeek-V2 normalises its latents with {_DEEPSEEK_LATENT_EPS} "
            "(ours: one eps for every norm); this checkpoint does not convert"
        )
    n_heads = hf["num_attention_heads"]
    fields = dict(
        attention_type="mla",
        n_kv_heads=n_heads,
        head_dim=_require(hf, "qk_nope_head_dim", where),
        rope_head_dim=_require(hf, "qk_rope_head_dim", where),
        v_head_dim=_require(hf, "v_head_dim", where),
        kv_lora_rank=_require(hf, "kv_lora_rank", where),
        q_lora_rank=hf.get("q_lora_rank") or 0,
    )
    if not hf.get("n_routed_experts") or hf.get("first_k_dense_replace", 0) >= hf["num_hidden_layers"]:
        return fields  # dense: no experts, or every block before first_k_dense_replace
    problems = []
    if hf.get("scoring_func", "softmax") != "softmax":
        problems.append(f"scoring_func={hf['scoring_func']!r} (ours: softmax for DeepSeek-V2)")
    method = hf.get("topk_method") or "greedy"
    groups = dict(router_groups=1, router_topk_groups=0)  # greedy
    if method == "group_limited_greedy":
        n_group, topk_group = hf.get("n_group"), hf.get("topk_group")
        ints = isinstance(n_group, int) and isinstance(topk_group, int)
        if not ints or n_group < 1 or topk_group < 1 or hf["n_routed_experts"] % n_group:
            raise UnsupportedArchitecture(
                f"{where}: topk_method='group_limited_greedy' needs n_group dividing n_routed_experts and topk_group >= 1, "
                f"got n_group={n_group}, topk_group={topk_group}; set both (topk_group = n_group routes greedily)"
            )
        if topk_group < n_group:
            groups = dict(router_groups=n_group, router_topk_groups=topk_group)
    elif method != "greedy":
        problems.append(f"topk_method={method!r} (ours: greedy or group_limited_greedy)")
    scale = hf.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
        problems.append(f"routed_scaling_factor={scale!r} (ours: a number > 0)")
    if hf.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={hf['moe_layer_freq']} (ours: MoE from first_k_dense_replace on)")
    if problems:
        raise UnsupportedArchitecture(f"{where} describes a model ours does not compute: {'; '.join(problems)}")
    first_dense = hf.get("first_k_dense_replace", 0)
    return fields | dict(
        n_experts=hf["n_routed_experts"],
        experts_per_token=_require(hf, "num_experts_per_tok", where),
        n_shared_experts=_shared_experts(hf, where),
        expert_mlp_dim=_require(hf, "moe_intermediate_size", where),
        first_dense_layers=first_dense,
        normalize_router_weights=False,  # transformers' DeepSeek-V2 ignores norm_topk_prob (4.x and 5.x alike)
        router_scale=float(scale),
        scan_layers=first_dense == 0,
    ) | groups


# ------------------------------------------------------------------------------------ tensor names


Entry = tuple[str, bool, np.ndarray | None] | None  # (name under model.layers.{i}, transpose, rows); None: not stored


def _interleaved(d: int) -> np.ndarray:
    """Row ``k`` of our rotate-half RoPE projection is row ``perm[k]`` of DeepSeek's, which rotates pairs ``(2i, 2i + 1)``."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def _per_head(n_heads: int, width: int, rows: np.ndarray) -> np.ndarray:
    """``rows`` of each head's ``width`` rows, head after head."""
    return np.concatenate([h * width + rows for h in range(n_heads)])


def _mla(cfg: ModelConfig) -> dict[Path_, Entry]:
    """DeepSeek-V2's attention names: ``kv_a_proj_with_mqa`` holds our latent and RoPE-key projections
    (rows ``[latent; rope key]``), ``kv_b_proj`` our key and value up-projections (per head ``[key; value]``)."""
    h, dn, dr, dv, r = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim, cfg.value_head_dim, cfg.kv_lora_rank
    q_rows = _per_head(h, dn + dr, np.concatenate([np.arange(dn), dn + _interleaved(dr)]))
    out: dict[Path_, Entry] = {}
    if cfg.q_lora_rank:
        out[("attn", "q_down", "kernel")] = ("self_attn.q_a_proj.weight", True, None)
        out[("attn", "q_norm", "scale")] = ("self_attn.q_a_layernorm.weight", False, None)
        out[("attn", "q_up", "kernel")] = ("self_attn.q_b_proj.weight", True, q_rows)
    else:
        out[("attn", "q_proj", "kernel")] = ("self_attn.q_proj.weight", True, q_rows)
    out[("attn", "kv_down", "kernel")] = ("self_attn.kv_a_proj_with_mqa.weight", True, np.arange(r))
    out[("attn", "k_rope_proj", "kernel")] = ("self_attn.kv_a_proj_with_mqa.weight", True, r + _interleaved(dr))
    out[("attn", "kv_norm", "scale")] = ("self_attn.kv_a_layernorm.weight", False, None)
    out[("attn", "k_up", "kernel")] = ("self_attn.kv_b_proj.weight", True, _per_head(h, dn + dv, np.arange(dn)))
    out[("attn", "v_up", "kernel")] = ("self_attn.kv_b_proj.weight", True, _per_head(h, dn + dv, dn + np.arange(dv)))
    out[("attn", "o_proj", "kernel")] = ("self_attn.o_proj.weight", True, None)
    return out


def _block(cfg: ModelConfig, moe: bool) -> dict[Path_, Entry]:
    """A block's leaves -> their `Entry`; ``{j}`` in a name is the expert."""
    out: dict[Path_, Entry] = {
        ("attn_norm", "scale"): ("input_layernorm.weight", False, None),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False, None),
    }
    if cfg.attention_type == "mla":
        out |= _mla(cfg)
    else:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[("attn", proj, "kernel")] = (f"self_attn.{proj}.weight", True, None)
    if cfg.qk_norm:
        out[("attn", "q_norm", "scale")] = ("self_attn.q_norm.weight", False, None)
        out[("attn", "k_norm", "scale")] = ("self_attn.k_norm.weight", False, None)
    dense = ("gate_proj", "up_proj", "down_proj")
    if not moe:
        for proj in dense:
            out[("mlp", proj, "kernel")] = (f"mlp.{proj}.weight", True, None)
        return out
    out[("mlp", "router", "bias")] = None  # selection-only bias: no transformers MoE here has one, so it must be zero
    if architecture(cfg) != _MIXTRAL:  # DeepSeek-V2, Qwen3-MoE
        out[("mlp", "router", "kernel")] = ("mlp.gate.weight", True, None)
        experts = zip(("w_gate", "w_up", "w_down"), (f"mlp.experts.{{j}}.{p}.weight" for p in dense), strict=True)
        for proj in dense if cfg.n_shared_experts else ():
            out[("mlp", "shared", proj, "kernel")] = (f"mlp.shared_experts.{proj}.weight", True, None)
    else:
        out[("mlp", "router", "kernel")] = ("block_sparse_moe.gate.weight", True, None)
        experts = (("w_gate", "block_sparse_moe.experts.{j}.w1.weight"), ("w_up", "block_sparse_moe.experts.{j}.w3.weight"),
                   ("w_down", "block_sparse_moe.experts.{j}.w2.weight"))  # fmt: skip
    for ours, theirs in experts:
        out[("mlp", ours)] = (theirs, True, None)
    return out


def _names(template: str, layers: list[int], n_experts: int) -> np.ndarray:
    """``template`` for each of ``layers`` (and each expert where it has ``{j}``), stacked in that order."""
    per_layer = []
    for i in layers:
        name = f"model.layers.{i}.{template}"
        per_layer.append([name.format(j=j) for j in range(n_experts)] if "{j}" in template else name)
    return np.array(per_layer, dtype=object)


def layout(cfg: ModelConfig) -> dict[Path_, Source | None]:
    """Every leaf of ``cfg``'s parameter dict -> its `Source` (None: a leaf transformers does not store, kept zero)."""
    architecture(cfg)
    one = lambda name: np.array(name, dtype=object)  # noqa: E731
    out: dict[Path_, Source | None] = {
        ("embed", "embedding"): Source(one("model.embed_tokens.weight"), False),
        ("final_norm", "scale"): Source(one("model.norm.weight"), False),
    }
    if not cfg.tie_embeddings:
        out[("lm_head", "kernel")] = Source(one("lm_head.weight"), True)
    if cfg.scan_layers:  # every block alike
        for sub, entry in _block(cfg, moe=cfg.n_experts > 0).items():
            out[("blocks", *sub)] = entry and Source(_names(entry[0], list(range(cfg.n_layers)), cfg.n_experts), *entry[1:])
    else:
        for i in range(cfg.n_layers):
            for sub, entry in _block(cfg, moe=cfg.is_moe_layer(i)).items():
                out[("blocks", i, *sub)] = entry and Source(_names(entry[0], [i], cfg.n_experts)[0, ...], *entry[1:])
    return out


def tensor_shapes(table: dict[Path_, Source | None], leaf_shapes: dict[Path_, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The shape of every transformers tensor the leaves (``leaf_shapes``) map to."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path, source in table.items():
        if source is None:
            continue
        shape = source.oriented_shape(leaf_shapes[path])
        if source.rows is not None:
            shape = (int(source.rows.max()) + 1, *shape[1:])
        for name in source.names.flat:
            old = shapes.get(name, shape)
            shapes[name] = (max(old[0], shape[0]), *shape[1:])
    return shapes


def _flat(tree: Params) -> dict[Path_, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): leaf for path, leaf in leaves}


def _checked_layout(cfg: ModelConfig, params: Params) -> dict[Path_, Source | None]:
    table, flat = layout(cfg), _flat(params)
    if set(table) != set(flat):
        unknown = sorted(map(str, set(flat) ^ set(table)))[:4]
        raise ValueError(f"the parameters do not match the model config (leaves {unknown} differ)")
    return table


# ------------------------------------------------------------------------------------ export


def to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Our parameters as transformers tensors by name (host NumPy arrays, float32). An FP8 model (``model.fp8``)
    exports its master weights: its scales and amax histories (`lm.fp8`) are training state, not weights."""
    params = fp8_lib.split(params)[0]
    table = _checked_layout(cfg, params)
    flat = _flat(params)
    shapes = tensor_shapes(table, {path: leaf.shape for path, leaf in flat.items()})
    tensors = {}
    for path, leaf in flat.items():
        value = np.asarray(jax.device_get(leaf), np.float32)
        source = table[path]
        if source is None:
            if np.any(value):
                raise UnsupportedArchitecture(
                    f"parameter {'.'.join(map(str, path))} is nonzero (the router's selection bias, model.bias_rate > 0); "
                    f"{architecture(cfg)} routes without it, so the exported model would choose other experts"
                )
            continue
        for index in np.ndindex(source.names.shape):
            name, part = source.names[index], value[index].T if source.transpose else value[index]
            if source.rows is None:
                tensors[name] = np.ascontiguousarray(part)
            else:
                tensors.setdefault(name, np.zeros(shapes[name], np.float32))[source.rows] = part
    return tensors


def save(
    directory: str | Path, cfg: ModelConfig, params: Params, *, max_shard_bytes: int = 5 * 2**30, dtype: str = "float32"
) -> list[Path]:
    """Writes ``config.json`` and the tensors as safetensors into ``directory``; returns the files written.

    ``dtype``: ``float32`` (exact) or ``bfloat16`` (rounded to nearest even; half the bytes).

    Tensors go into one ``model.safetensors`` when they fit in ``max_shard_bytes``, else into
    ``model-0000k-of-0000n.safetensors`` files of at most that size (a larger single tensor gets a file
    of its own) with the ``model.safetensors.index.json`` that maps each name to its file. The weight files
    of an earlier save into ``directory`` are removed first: a stale index would be read before a new single
    file, and stale shards after a new index.
    """
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(EXPORT_DTYPES)}")
    tensors = {name: t.astype(EXPORT_DTYPES[dtype]) for name, t in to_hf_tensors(cfg, params).items()}
    hf_config = to_hf_config(cfg, dtype)  # both raise on a model without an equivalent: before anything is removed
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in [directory / SINGLE_FILE, directory / INDEX_FILE, *directory.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    (directory / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / SINGLE_FILE, metadata={"format": "pt"})
        return [directory / CONFIG, directory / SINGLE_FILE]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, directory / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": {name: file for file, shard in zip(files, shards, strict=True) for name in shard},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / CONFIG, *(directory / f for f in files), directory / INDEX_FILE]


# ------------------------------------------------------------------------------------ import


def _read_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; `UnreadableCheckpoint` (naming the file and ``fix``) if it is missing or malformed."""
    try:
        out = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise UnreadableCheckpoint(f"{path} does not exist; {fix}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableCheckpoint(f"{path} is not readable JSON ({e}); {fix}") from e
    if not isinstance(out, dict):
        raise UnreadableCheckpoint(f"{path} holds a JSON {type(out).__name__}, not an object; {fix}")
    return out


_COPY_AGAIN = "download or copy the checkpoint again"


def read_config(directory: str | Path, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of the transformers checkpoint in ``directory`` (see `from_hf_config`)."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise UnreadableCheckpoint(f"{path} does not exist; give the folder of a transformers checkpoint (config.json, *.safetensors)")
    return from_hf_config(_read_json(path, _COPY_AGAIN), str(path), **overrides)


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or the one file's header)."""
    if (directory / INDEX_FILE).is_file():
        weight_map = _read_json(directory / INDEX_FILE, _COPY_AGAIN).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UnreadableCheckpoint(f"{directory / INDEX_FILE} has no 'weight_map' object; {_COPY_AGAIN}")
        out = {name: directory / file for name, file in weight_map.items()}
        if missing := sorted({str(f) for f in out.values() if not f.is_file()}):
            raise UnreadableCheckpoint(f"shard {missing[0]} named in {INDEX_FILE} does not exist ({len(missing)} missing); {_COPY_AGAIN}")
        return out
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise UnreadableCheckpoint(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}; is it a transformers safetensors checkpoint?")
    with _open_files({single}) as handles:
        return dict.fromkeys(handles[single].keys(), single)


@contextlib.contextmanager
def _open_files(files: set[Path]) -> Iterator[dict[Path, Any]]:
    """Each safetensors file open for reading; `UnreadableCheckpoint` names one that is truncated or corrupt."""
    from safetensors import SafetensorError, safe_open

    with contextlib.ExitStack() as stack:
        handles = {}
        for file in sorted(files):
            try:
                handles[file] = stack.enter_context(safe_open(file, "numpy"))
            except (SafetensorError, OSError) as e:
                raise UnreadableCheckpoint(f"{file} is not a readable safetensors file ({e}); it may be truncated: {_COPY_AGAIN}") from e
        yield handles


def load_params(directory: str | Path, cfg: ModelConfig, abstract: Params, shardings: Params | None = None) -> Params:
    """The transformers tensors in ``directory`` as our parameters (float32), placed in ``shardings``.

    Each device's shard is read from the files alone (safetensors ``get_slice``): a process reads only
    the slices its devices hold, and no host holds a whole stacked array unless its devices do. The
    tensors that hold reordered rows or two of our leaves (DeepSeek-V2's query and KV projections,
    `Source.rows`) are read whole, one layer at a time, for each shard.

    Args:
      directory: holds ``model.safetensors`` or the ``model.safetensors.index.json`` of its shards.
      cfg: the model config (`read_config`); ``abstract``: its parameter shapes (`lm.model.define`); an FP8
        model's scaling state starts as `lm.fp8.initial_scaling`.
      shardings: a `jax.sharding.Sharding` per leaf; None: the first device.

    Raises:
      CheckpointMismatch: a tensor is missing or has another shape than the model needs (named).
      UnreadableCheckpoint: a file is missing, truncated or corrupt (named).
    """
    directory = Path(directory)
    table = _checked_layout(cfg, fp8_lib.split(abstract)[0])
    weight_map = _weight_map(directory)
    flat_shardings = _flat(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = _flat(abstract)
    shapes = tensor_shapes(table, {path: leaf.shape for path, leaf in flat.items()})
    needed = {name for s in table.values() if s is not None for name in s.names.flat}
    missing = sorted(needed - set(weight_map))
    if missing:
        raise CheckpointMismatch(f"{directory} lacks tensor {missing[0]} ({len(missing)} missing) that the model of its config.json needs")
    unused = sorted(name for name in set(weight_map) - needed if not name.endswith(_BUFFERS))
    if unused:
        raise CheckpointMismatch(f"{directory} holds tensor {unused[0]} ({len(unused)} in all) that the model of its config.json has no place for")
    out = {}
    with _open_files({weight_map[name] for name in needed}) as handles:
        for path, leaf in flat.items():
            sharding = flat_shardings.get(path, default)
            if path not in table:  # an FP8 model's scaling state (`lm.fp8`): as the model initialises it
                out[path] = jax.jit(lambda name=path[-1], s=leaf.shape: fp8_lib.initial_scaling(name, s), out_shardings=sharding)()
                continue
            source = table[path]
            if source is None:
                out[path] = jax.jit(lambda s=leaf.shape: jnp.zeros(s, jnp.float32), out_shardings=sharding)()
                continue
            slices = {name: _slice(handles[weight_map[name]], name, weight_map[name]) for name in source.names.flat}
            for name, tensor in slices.items():
                if tuple(tensor.get_shape()) != (expected := shapes[name]):
                    raise CheckpointMismatch(
                        f"tensor {name} in {directory} has shape {tuple(tensor.get_shape())}; the model of its config.json needs {expected}"
                    )
            out[path] = jax.make_array_from_callback(leaf.shape, sharding, _reader(source, slices))
    return _unflatten(out)


def _slice(handle: Any, name: str, file: Path) -> Any:
    from safetensors import SafetensorError

    try:
        return handle.get_slice(name)
    except SafetensorError as e:
        raise UnreadableCheckpoint(f"{file} lacks tensor {name}, which {INDEX_FILE} places there ({e}); {_COPY_AGAIN}") from e


def _reader(source: Source, slices: dict[str, Any]):
    """The callback that reads one shard (an index into the leaf) of a leaf from its tensors' slices."""
    lead = source.names.ndim

    def read(index: tuple[slice, ...]) -> np.ndarray:
        inner = index[lead:]
        names = source.names[(*index[:lead], ...)]
        parts = []
        for i in np.ndindex(names.shape):
            if source.rows is None:  # read only this shard's slice
                part = slices[names[i]][inner[::-1] if source.transpose else inner]
                part = part.T if source.transpose else part
            else:  # this leaf's rows of a shared or reordered tensor
                part = slices[names[i]][:][source.rows]
                part = (part.T if source.transpose else part)[inner]
            parts.append(part.astype(np.float32))
        return np.stack(parts).reshape(*names.shape, *parts[0].shape)

    return read


def _unflatten(flat: dict[Path_, Any]) -> Params:
    out: Params = {}
    for path, leaf in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def load_model(
    directory: str | Path, mesh: jax.sharding.Mesh | None = None, rules: rules_lib.Rules | None = None, **overrides: Any
) -> tuple[model_lib.ModelDef, Params]:
    """A local transformers checkpoint (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V2) as ``(model_def, params)``.

    The config comes from ``directory/config.json`` with ``overrides`` (``dtype``, ``scan_layers``,
    ``attention``, ...). With ``mesh`` the parameters are placed by ``rules`` (default: the ``fsdp``
    preset), each device's shard read straight from the files; without, on the first device.
    """
    model_def = model_lib.define(read_config(directory, **overrides))
    shardings = None
    if mesh is not None:
        rules = rules or rules_lib.make_rules()
        shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    return model_def, load_params(directory, model_def.config, model_def.abstract_params, shardings)
