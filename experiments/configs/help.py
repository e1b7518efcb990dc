"""``--list_config``: every ``--config.<key>`` with its value and one line of help.

The help is where the key is declared: the comment beside it in ``default.py``, beside the
`lm.config.ModelConfig` or `lm.data.input_pipeline.DataConfig` field, or an optimizer spec's field
documentation (`optim.spec.field_docs`). Each optimizer's block is headed by its default learning
rate and weight decay, the values ``optimizer.learning_rate`` / ``weight_decay`` take when unset.
"""

from __future__ import annotations

import inspect
import re

import ml_collections

from experiments.configs import default
from lm import config as model_config
from lm.data import input_pipeline
from optim import lookahead, registry, spec, tail_average

_ASSIGNED = re.compile(r"^\s*(config|opt)\.([\w.]+)\s*=.*?\s#\s+(.*)$")
_FIELD = re.compile(r"^\s*(\w+):\s*[^=]+=.*?\s#\s+(.*)$")
# Model fields whose declaration has no comment (lm/config.py).
_MODEL_HELP = {
    "vocab_size": "token ids (embedding rows); unset: the preset's, or the training shards' manifest's, padded to 128",
    "d_model": "width of the residual stream",
    "n_layers": "transformer blocks",
    "n_heads": "query heads",
    "n_kv_heads": "key/value heads (grouped-query attention; n_heads must divide by it)",
    "head_dim": "width of each attention head",
    "mlp_dim": "hidden width of each SwiGLU MLP",
    "max_seq_len": "longest sequence the model takes (data.seq_len <= it)",
    "rope_theta": "RoPE base frequency",
    "norm_eps": "RMSNorm epsilon",
    "tie_embeddings": "the readout shares the embedding matrix",
    "qk_norm": "RMSNorm on queries and keys (Qwen3)",
    "experts_per_token": "routed experts each token uses (top-k)",
}


def _comments(source: str, pattern: re.Pattern, prefix: str = "") -> dict[str, str]:
    """Trailing comments of assignments, or the comment lines right above one, by key."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        match = pattern.match(line)
        if match is not None:
            *names, text = match.groups()
            key = names[-1] if len(names) == 1 else ("optimizer." if names[0] == "opt" else "") + names[1]
            out[prefix + key] = text
        elif "=" in line and above:
            name = re.match(r"^\s*(?:config|opt)\.([\w.]+)\s*=|^\s*(\w+):\s*[^=]+=", line)
            if name is not None:
                key = name.group(1) or name.group(2)
                key = "optimizer." + key if line.strip().startswith("opt.") else key
                out[prefix + key] = " ".join(above)
        above = []
    return out


def key_help() -> dict[str, str]:
    """One line of help per flattened config key of `default.get_config`."""
    out = _comments(inspect.getsource(default), _ASSIGNED)
    out |= {f"model.{k}": v for k, v in _MODEL_HELP.items()}
    out |= _comments(inspect.getsource(model_config.ModelConfig), _FIELD, "model.")
    out["model.preset"] = f"a preset of lm/config.py ({', '.join(model_config.PRESETS)}); the other keys override it"
    out |= _comments(inspect.getsource(input_pipeline.DataConfig), _FIELD, "data.")
    for name, fn in (("lookahead", lookahead.lookahead), ("tail_average", tail_average.tail_average)):
        out |= {f"optimizer.{name}.{k}": v for k, v in spec.arg_docs(fn).items()}
    for name, cls in registry.OPTIMIZERS.items():
        out |= {f"optimizer.{name}.{k}": v for k, v in spec.field_docs(cls).items()}
        if issubclass(cls, spec.WrapperSpec):
            out[f"optimizer.{name}.inner"] = "the registered optimizer it runs inside (its block sets it)"
    return {k: " ".join(v.split()) for k, v in out.items()}


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted key, value)`` of every leaf of ``config``."""
    out = []
    for key in config.keys():
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def _family_header(name: str) -> str:
    cls = registry.OPTIMIZERS[name]
    fields = spec.defaults(cls)
    parts = [f"learning_rate {fields['learning_rate']}"] if "learning_rate" in fields else ["learning rate: its inner optimizer's"]
    if cls.applies_weight_decay and "weight_decay" in fields:
        parts.append(f"weight_decay {fields['weight_decay']}")
    return f"# optimizer.{name}: defaults {', '.join(parts)} ({cls.__module__})"


def listing(config: ml_collections.ConfigDict) -> str:
    """Every key of ``config`` as ``--config.<key>=<value>  # help``, optimizer blocks headed by their defaults."""
    helps = key_help()
    lines, family = [], None
    preset = model_config.PRESETS.get(config.model.get("preset"), {}) if "model" in config else {}
    fields = {f: getattr(model_config.ModelConfig(), f) for f in model_config.ModelConfig.__dataclass_fields__}
    for key, value in flatten(config):
        parts = key.split(".")
        if parts[0] == "optimizer" and len(parts) == 3 and parts[1] != family and parts[1] in registry.OPTIMIZERS:
            family = parts[1]
            lines.append(_family_header(family))
        text = f"--config.{key}={value!r}" if isinstance(value, str) else f"--config.{key}={value}"
        help_text = helps.get(key, "")
        if value is None and parts[0] == "model" and parts[1] in fields:
            help_text = f"(unset: {preset.get(parts[1], fields[parts[1]])}) {help_text}"
        lines.append(f"{text:<52}  # {help_text}" if help_text else text)
    return "\n".join(lines)
