"""Hugging Face transformers checkpoints: our parameter tree and `ModelConfig` in their names and layouts.

Each of our parameter leaves maps to one or more transformers tensors (`Source`):

- a kernel ``(fan_in, fan_out)`` is a ``Linear.weight`` ``(out, in)``: the transpose;
- under ``scan_layers`` a block leaf carries a leading ``layers`` axis; layer ``i`` is ``model.layers.{i}``;
- an MoE expert stack ``(experts, in, out)`` is one tensor per expert;
- tied embeddings have no ``lm_head.weight`` (``tie_word_embeddings``).

The architecture follows from the config (`architecture`): Llama for dense grouped-query attention,
Qwen3 when QK-norm is on (``self_attn.{q,k}_norm``), Mixtral for a routed MoE in every block without
shared experts (``block_sparse_moe.gate``, ``experts.{j}.w1`` gate / ``w3`` up / ``w2`` down). Both
sides rotate halves in RoPE (pairs ``(x_i, x_{i + d/2})``, transformers' ``rotate_half``), so query
and key rows keep their order. Anything else has no transformers equivalent here and is an
`UnsupportedArchitecture` naming the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm.config import ModelConfig

Params = dict[str, Any]
Path_ = tuple[Any, ...]  # a leaf's keys in the parameter dict, e.g. ("blocks", "attn", "q_proj", "kernel")

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# The ModelConfig fields a transformers config.json decides (the rest say how to compute, not what).
CONFIG_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "max_seq_len", "rope_theta",
    "norm_eps", "tie_embeddings", "qk_norm", "attention_type", "n_experts", "experts_per_token", "n_shared_experts",
    "moe_every", "first_dense_layers", "expert_mlp_dim", "router_score", "normalize_router_weights",
)  # fmt: skip

_LLAMA, _QWEN3, _MIXTRAL = "LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"
_MODEL_TYPES = {_LLAMA: "llama", _QWEN3: "qwen3", _MIXTRAL: "mixtral"}


class UnsupportedArchitecture(ValueError):
    """A model (or a transformers config) that has no equivalent on the other side."""


class CheckpointMismatch(ValueError):
    """A transformers checkpoint whose tensors do not fit the model (a name or shape differs)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of our leaves lives in a transformers checkpoint.

    Attributes:
      names: the tensor names, an array shaped like the leaf's stacked leading axes (``layers`` under
        ``scan_layers``, then ``experts``); 0-d for an unstacked leaf.
      transpose: each tensor is the transpose of the leaf's trailing matrix (a Linear weight).
    """

    names: np.ndarray
    transpose: bool

    def tensor_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        inner = leaf_shape[self.names.ndim :]
        return inner[::-1] if self.transpose else inner


# ------------------------------------------------------------------------------------ architecture


def architecture(cfg: ModelConfig) -> str:
    """The transformers architecture of ``cfg`` (``LlamaForCausalLM``, ...); raises where there is none."""
    if cfg.attention_type != "gqa":
        raise UnsupportedArchitecture(
            "model.attention_type=mla (DeepSeek-V2's multi-head latent attention) has no converter yet; "
            "only grouped-query attention models (Llama, Qwen3, Mixtral) convert"
        )
    if not cfg.n_experts:
        return _QWEN3 if cfg.qk_norm else _LLAMA
    differences = []
    if cfg.qk_norm:
        differences.append("model.qk_norm=True (Mixtral has no QK-norm)")
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


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers ``config.json`` of ``cfg`` (float32 weights)."""
    arch = architecture(cfg)
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
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
    if arch == _LLAMA:
        out["mlp_bias"] = False
    if arch == _QWEN3:
        out |= {"use_sliding_window": False, "sliding_window": None}
    if arch == _MIXTRAL:
        out |= {
            "intermediate_size": cfg.expert_mlp_dim or cfg.mlp_dim,
            "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "sliding_window": None,
        }
    return out


def _require(hf: dict[str, Any], key: str, where: str) -> Any:
    if key not in hf:
        raise UnsupportedArchitecture(f"{where} has no {key!r}; is it a transformers config.json?")
    return hf[key]


def from_hf_config(hf: dict[str, Any], where: str = CONFIG, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a transformers ``config.json`` (``hf``), with ``overrides`` (``dtype``, ``scan_layers``, ...).

    Raises:
      UnsupportedArchitecture: an architecture other than Llama / Qwen3 / Mixtral, or a setting our
        model does not compute (RoPE scaling, biases, sliding windows, another activation), named.
    """
    archs = _require(hf, "architectures", where)
    arch = archs[0] if isinstance(archs, list) and archs else archs
    if arch not in _MODEL_TYPES:
        raise UnsupportedArchitecture(f"{where}: architecture {arch!r} does not convert; supported: {', '.join(_MODEL_TYPES)}")
    problems = []
    if hf.get("rope_scaling"):
        problems.append(f"rope_scaling={hf['rope_scaling']!r} (our RoPE is unscaled)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (our projections have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (our MLP is SwiGLU)")
    if hf.get("sliding_window") and (arch == _MIXTRAL or hf.get("use_sliding_window")):
        problems.append(f"sliding_window={hf['sliding_window']} (our attention is full causal)")
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
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch == _QWEN3,
    )
    if arch == _MIXTRAL:
        fields |= dict(
            n_experts=_require(hf, "num_local_experts", where),
            experts_per_token=_require(hf, "num_experts_per_tok", where),
            expert_mlp_dim=fields["mlp_dim"],
            normalize_router_weights=True,
        )
    return ModelConfig(**(fields | overrides))


# ------------------------------------------------------------------------------------ tensor names


def _block(cfg: ModelConfig, moe: bool) -> dict[Path_, tuple[str, bool] | None]:
    """A block's leaves -> ``(name under model.layers.{i}, transpose)``; ``{j}`` is the expert; None: not stored."""
    out: dict[Path_, tuple[str, bool] | None] = {
        ("attn_norm", "scale"): ("input_layernorm.weight", False),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False),
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[("attn", proj, "kernel")] = (f"self_attn.{proj}.weight", True)
    if cfg.qk_norm:
        out[("attn", "q_norm", "scale")] = ("self_attn.q_norm.weight", False)
        out[("attn", "k_norm", "scale")] = ("self_attn.k_norm.weight", False)
    if moe:
        out[("mlp", "router", "kernel")] = ("block_sparse_moe.gate.weight", True)
        out[("mlp", "router", "bias")] = None  # selection-only bias: Mixtral has none, so it must be zero
        for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            out[("mlp", ours)] = (f"block_sparse_moe.experts.{{j}}.{theirs}.weight", True)
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[("mlp", proj, "kernel")] = (f"mlp.{proj}.weight", True)
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
    for sub, entry in _block(cfg, moe=cfg.n_experts > 0).items():
        if cfg.scan_layers:
            out[("blocks", *sub)] = entry and Source(_names(entry[0], list(range(cfg.n_layers)), cfg.n_experts), entry[1])
        else:
            for i in range(cfg.n_layers):
                out[("blocks", i, *sub)] = entry and Source(_names(entry[0], [i], cfg.n_experts)[0, ...], entry[1])
    return out


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
    """Our parameters as transformers tensors by name (host NumPy arrays, float32)."""
    table = _checked_layout(cfg, params)
    tensors = {}
    for path, leaf in _flat(params).items():
        value = np.asarray(jax.device_get(leaf), np.float32)
        source = table[path]
        if source is None:
            if np.any(value):
                raise UnsupportedArchitecture(
                    f"parameter {'.'.join(map(str, path))} is nonzero (the router's selection bias, model.bias_rate > 0); "
                    "Mixtral routes without it, so the exported model would choose other experts"
                )
            continue
        for index in np.ndindex(source.names.shape):
            tensor = value[index]
            tensors[source.names[index]] = np.ascontiguousarray(tensor.T if source.transpose else tensor)
    return tensors


def save(directory: str | Path, cfg: ModelConfig, params: Params, *, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Writes ``config.json`` and the tensors as safetensors into ``directory``; returns the files written.

    Tensors go into one ``model.safetensors`` when they fit in ``max_shard_bytes``, else into
    ``model-0000k-of-0000n.safetensors`` files of at most that size (a larger single tensor gets a file
    of its own) with the ``model.safetensors.index.json`` that maps each name to its file.
    """
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_tensors(cfg, params)
    (directory / CONFIG).write_text(json.dumps(to_hf_config(cfg), indent=2) + "\n")
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


def read_config(directory: str | Path, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of the transformers checkpoint in ``directory`` (see `from_hf_config`)."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give the folder of a transformers checkpoint (config.json, *.safetensors)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    return from_hf_config(hf, str(path), **overrides)


def _weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or the one file's header)."""
    from safetensors import safe_open

    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}; is it a transformers safetensors checkpoint?")
    with safe_open(single, "numpy") as f:
        return dict.fromkeys(f.keys(), single)


@contextlib.contextmanager
def _open_files(files: set[Path]) -> Iterator[dict[Path, Any]]:
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        yield {file: stack.enter_context(safe_open(file, "numpy")) for file in files}


def load_params(directory: str | Path, cfg: ModelConfig, abstract: Params, shardings: Params | None = None) -> Params:
    """The transformers tensors in ``directory`` as our parameters (float32), placed in ``shardings``.

    Each device's shard is read from the files alone (safetensors ``get_slice``): a process reads only
    the slices its devices hold, and no host holds a whole stacked array unless its devices do.

    Args:
      directory: holds ``model.safetensors`` or the ``model.safetensors.index.json`` of its shards.
      cfg: the model config (`read_config`); ``abstract``: its parameter shapes (`lm.model.define`).
      shardings: a `jax.sharding.Sharding` per leaf; None: the first device.

    Raises:
      CheckpointMismatch: a tensor is missing or has another shape than the model needs (named).
    """
    directory = Path(directory)
    table = _checked_layout(cfg, abstract)
    weight_map = _weight_map(directory)
    flat_shardings = _flat(shardings) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = _flat(abstract)
    needed = {name for s in table.values() if s is not None for name in s.names.flat}
    missing = sorted(needed - set(weight_map))
    if missing:
        raise CheckpointMismatch(f"{directory} lacks tensor {missing[0]} ({len(missing)} missing) that the model of its config.json needs")
    unused = sorted(set(weight_map) - needed)
    if unused:
        raise CheckpointMismatch(f"{directory} holds tensor {unused[0]} ({len(unused)} in all) that the model of its config.json has no place for")
    out = {}
    with _open_files({weight_map[name] for name in needed}) as handles:
        for path, leaf in flat.items():
            sharding = flat_shardings.get(path, default)
            source = table[path]
            if source is None:
                out[path] = jax.jit(lambda s=leaf.shape: jnp.zeros(s, jnp.float32), out_shardings=sharding)()
                continue
            slices = {name: handles[weight_map[name]].get_slice(name) for name in source.names.flat}
            expected = source.tensor_shape(leaf.shape)
            for name, tensor in slices.items():
                if tuple(tensor.get_shape()) != expected:
                    raise CheckpointMismatch(
                        f"tensor {name} in {directory} has shape {tuple(tensor.get_shape())}; the model of its config.json needs {expected}"
                    )
            out[path] = jax.make_array_from_callback(leaf.shape, sharding, _reader(source, slices))
    return _unflatten(out)


def _reader(source: Source, slices: dict[str, Any]):
    """The callback that reads one shard (an index into the leaf) of a leaf from its tensors' slices."""
    lead = source.names.ndim

    def read(index: tuple[slice, ...]) -> np.ndarray:
        inner = index[lead:]
        names = source.names[(*index[:lead], ...)]
        parts = []
        for i in np.ndindex(names.shape):
            part = slices[names[i]][inner[::-1] if source.transpose else inner]
            parts.append((part.T if source.transpose else part).astype(np.float32))
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
