"""Building a run from its config: the model, the optimizer, the mesh and every sharding, checked.

`build_run` turns a config (``experiments/configs/default.py``) into a `RunSpec` (no data, no
allocation) and reports every bad input as a `UsageError`; every entry point (training, sampling,
benchmarks, the planner) builds its run here. `run_meta` is what a checkpoint must agree with.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import jax
import ml_collections

from experiments import profiling, train_lib
from experiments.cli import UsageError
from kernels_pallas.attention import api as attention_api
from lm import config as model_config_lib
from lm import fp8, hf, moe
from lm import model as model_lib
from lm.data import input_pipeline
from lm.data import tokenizer as tokenizer_lib
from lm.parallel import check as parallel
from lm.parallel import vocab_parallel
from optim import build, registry, schedules
from optim import spec as spec_lib
from sharding import axes
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

# Common optimizer keys that change the optimizer state's structure.
STATE_SHAPING_KEYS = ("state_bits", "cautious")

# Model fields a resumed run may change: they alter how the step computes, not what the state is.
RESUMABLE_MODEL_CHANGES = (
    "attention", "dtype", "remat", "scan_unroll", "track_attn_logits", "loss_chunk",
    "context_parallel", "pipeline_schedule", "pipeline_microbatches", "pipeline_repeats",
    "pipeline_vocab_parallel", "pipeline_skip_rate",
)  # fmt: skip


def data_config(config: ml_collections.ConfigDict) -> input_pipeline.DataConfig:
    """The `DataConfig` of ``config.data`` (defaults for keys an older run's config lacks)."""
    values = config.data.to_dict()
    known = {f.name for f in dataclasses.fields(input_pipeline.DataConfig)}
    if unknown := sorted(set(values) - known):
        raise ValueError(
            f"config.data has no setting {', '.join(unknown)}: the data settings are {', '.join(sorted(known))} "
            "(`python -m experiments.train --list_config` explains each); remove or rename it"
        )
    return input_pipeline.DataConfig(**values)


def model_config(config: ml_collections.ConfigDict) -> model_config_lib.ModelConfig:
    """The `ModelConfig` for ``config.model``: the preset plus every key that is set (the vocabulary, when
    unset, from the manifest of ``data.train_files`` if they have one; the document separator, when
    unset, from ``data.document_mask``)."""
    overrides = {k: v for k, v in config.model.items() if k != "preset" and v is not None}
    if config.get("init_from_hf"):
        return _hf_model_config(config, overrides)
    if "vocab_size" not in overrides and (vocab_size := input_pipeline.manifest_vocab_size(data_config(config))) is not None:
        overrides["vocab_size"] = vocab_size
    if "document_separator" not in overrides:
        overrides["document_separator"] = input_pipeline.document_separator(data_config(config))
    return model_config_lib.from_preset(config.model.preset, **overrides)


def _hf_model_config(config: ml_collections.ConfigDict, overrides: dict) -> model_config_lib.ModelConfig:
    """The model of the transformers checkpoint ``config.init_from_hf``; ``config.model`` (its keys, and a chosen
    preset's) may set only how it computes (``dtype``, ``remat``, ``scan_layers``, ...), an architecture field
    that differs is an error."""
    directory = config.init_from_hf
    try:
        from_hf = hf.read_config(directory)
    except (hf.CheckpointError, FileNotFoundError) as e:
        raise ValueError(f"init_from_hf: {e}") from e
    defaults = {f.name: f.default for f in dataclasses.fields(model_config_lib.ModelConfig)}
    conflicts = [
        f"model.{k}={v!r} (config.json: {getattr(from_hf, k)!r})"
        for k, v in overrides.items()
        if k in hf.CONFIG_FIELDS and v != defaults[k] and v != getattr(from_hf, k)
    ]
    preset = config.model.preset
    chosen = {} if preset == model_config_lib.DEFAULT_PRESET else model_config_lib.preset_fields(preset)  # the default: no choice
    conflicts += [
        f"model.preset={preset} ({k}={v!r}; config.json: {getattr(from_hf, k)!r})"
        for k, v in chosen.items()
        if k in hf.CONFIG_FIELDS and k not in overrides and v != getattr(from_hf, k)
    ][:1]
    if conflicts:
        raise ValueError(f"init_from_hf={directory} fixes the architecture, but the config sets {', '.join(conflicts)}; drop those keys")
    computes = {k: v for k, v in {**chosen, **overrides}.items() if k not in hf.CONFIG_FIELDS}
    try:
        return hf.read_config(directory, **computes, document_separator=input_pipeline.document_separator(data_config(config)))
    except hf.CheckpointError as e:
        raise ValueError(f"init_from_hf: {e}") from e


def check_hf_tokenizer(config: ml_collections.ConfigDict) -> None:
    """A run that starts from ``config.init_from_hf``, a checkpoint holding its tokenizer file, trains only on
    data made with that file: the text corpus (bytes) or shards whose manifest names another tokenizer would
    feed it ids that mean other text. Shards without a manifest and checkpoints without a tokenizer
    (byte-level exports) are not checked.

    Raises:
      ValueError: the data was made with another tokenizer; the line names the command that makes shards of its.
    """
    directory, data = config.init_from_hf, data_config(config)
    theirs = tokenizer_lib.find_in(directory)
    if theirs is None:
        return
    if input_pipeline.train_patterns(data):
        manifest = input_pipeline.train_manifest(data)
        if manifest is None or manifest.get("tokenizer_sha256") is None:
            return
        ours, fingerprint = f"{manifest.get('tokenizer')} (the shards' manifest)", manifest["tokenizer_sha256"]
    else:
        ours, fingerprint = "the byte-level tokenizer (the text corpus)", tokenizer_lib.load("bytes").fingerprint
    if tokenizer_lib.file_fingerprint(theirs) != fingerprint:
        raise ValueError(
            f"init_from_hf={directory} was trained with its {theirs.name}, but this run's data was made with {ours}; "
            f"train on shards of its tokenizer: python -m experiments.tokenize --tokenizer={theirs} --out=DIR, then "
            "--config.data.train_files='DIR/train_*.bin' --config.data.val_files='DIR/val_*.bin'"
        )


def balancing(config: ml_collections.ConfigDict) -> moe.Balancing:
    """The MoE balancing of ``config.moe`` (defaults where a config has no ``moe`` block)."""
    block = config.get("moe") or {}
    names = {"balance_loss": "balance_loss", "router_z_loss": "router_z_loss", "balance_scope": "scope", "bias_rate": "bias_rate"}
    return moe.Balancing(**{field: block[key] for key, field in names.items() if key in block})


def run_meta(config: ml_collections.ConfigDict, cfg: model_config_lib.ModelConfig, replicas: int = 1) -> dict:
    """What a checkpoint must agree with to be resumed by this run.

    A wrapper's inner optimizer shapes the state too, so its block is included. A replica-local
    run's state holds one slice per replica, so it resumes only with the same replica axis and count
    (a different count is refused with the difference named).
    """
    name = config.optimizer.name
    family = config.optimizer.get(name)
    family = family.to_dict() if family is not None else {}
    inner = build.inner_name(config.optimizer)
    if inner is not None and config.optimizer.get(inner) is not None:
        family[inner] = config.optimizer[inner].to_dict()
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_MODEL_CHANGES}
    meta = {"replicas": {"axis": config.replicas, "count": replicas}} if config.get("replicas") else {}
    return meta | {
        "model": model,
        "optimizer": {
            "name": name,
            **family,
            **{k: config.optimizer[k] for k in STATE_SHAPING_KEYS if k in config.optimizer},
        },
    }


def upgrade_meta(saved: dict) -> dict:
    """A checkpoint's `run_meta` in today's form: model fields added since it was written take their defaults
    (a new field's default is the behaviour before it existed), fields now resumable are dropped."""
    if not isinstance(saved.get("model"), dict):
        return saved
    defaults = dataclasses.asdict(model_config_lib.ModelConfig())
    model = {k: v for k, v in (defaults | saved["model"]).items() if k not in RESUMABLE_MODEL_CHANGES}
    return saved | {"model": model}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The model, optimizer and placement a config describes (no data, no allocation)."""

    cfg: model_config_lib.ModelConfig
    model_def: model_lib.ModelDef
    tx: Any
    mesh: jax.sharding.Mesh
    rules: rules_lib.Rules
    shardings: train_lib.Shardings


def _check_replica_kernels(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """Pallas kernels run interpreted on a CPU, which the replica-local step cannot host (`kernels_pallas.varying`)."""
    if mesh.devices.flat[0].platform != "cpu":
        return
    chosen = {
        "model.attention": (config.model.attention, "pallas", "xla"),
        "model.moe_matmul": (config.model.moe_matmul, "gmm", "ragged_dot"),
        "optimizer.state_kernel": (config.optimizer.state_kernel, "pallas", "xla"),
    }
    for key, (value, kernel, fix) in chosen.items():
        if value == kernel:
            raise ValueError(
                f"{key}={kernel} runs in Pallas interpret mode on a CPU, which cannot run inside the replica-local "
                f"train step (config.replicas); use {key}={fix} or auto here (compiled GPU/TPU kernels are unaffected)"
            )


def _check_attention_platform(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """cuDNN's attention runs on NVIDIA GPUs only; named elsewhere, jax would fail inside the first step
    ("cuDNN is not detected")."""
    platform = mesh.devices.flat[0].platform
    if config.model.attention == "cudnn" and platform not in ("gpu", "cuda"):
        auto = attention_api.ORDER.get(platform, ("xla",))[0]
        raise ValueError(
            f"model.attention=cudnn runs on NVIDIA GPUs, and this run's devices are {platform}: use model.attention=auto "
            f"({auto} here) or one of {', '.join(n for n in attention_api.IMPLEMENTATIONS if n != 'cudnn')}"
        )


def _check_replicas_named(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """A replica-local optimizer on several devices needs a replica axis, or it runs as one global replica."""
    name = config.optimizer.name
    if registry.spec_class(name).replica_local and mesh.size > 1 and not config.get("replicas"):
        raise ValueError(
            f"optimizer {name!r} exchanges updates between data-parallel replicas, but the {mesh.size} devices of mesh "
            f"{dict(mesh.shape)} form one replica; add --config.replicas=data (or run it on one device)"
        )


def build_run(config: ml_collections.ConfigDict) -> RunSpec:
    """Checks ``config`` and builds its `RunSpec`; every bad-input error becomes a `UsageError`."""
    try:
        check_values(config)
        profile = profiling.parse_steps(config.get("profile", ""))
        if profile and profile[0] > config.steps:
            raise ValueError(f"profile={config.profile!r} starts after the run's last step (steps={config.steps}), so it would trace nothing")
        if config.grad_accum_steps < 1 or config.batch_size % config.grad_accum_steps:
            raise ValueError(f"batch_size={config.batch_size} must be a multiple of grad_accum_steps={config.grad_accum_steps}")
        cfg = model_config(config)
        if "attn_max_logits" in registry.spec_class(config.optimizer.name).extra_args:
            if cfg.attention_window:
                raise ValueError(
                    f"optimizer {config.optimizer.name} clips by the attention's max logits, which windowed attention does not "
                    f"track; set model.attention_window=0 or use another optimizer (e.g. muon)"
                )
            cfg = dataclasses.replace(cfg, track_attn_logits=True)
        if config.data.seq_len > cfg.max_seq_len:
            raise ValueError(
                f"data.seq_len={config.data.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}; "
                f"lower data.seq_len or raise model.max_seq_len to at least {config.data.seq_len}"
            )
        if config.devices and jax.process_count() > 1:
            raise ValueError("config.devices selects local devices and works only in single-process runs; leave it 0")
        if config.devices > len(jax.devices()):
            raise ValueError(f"config.devices={config.devices} but only {len(jax.devices())} devices are present")
        mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[: config.devices] if config.devices else None)
        rules = rules_lib.make_rules(config.rules, rules_lib.parse_overrides(config.get("rule_overrides", "")))
        rules = vocab_parallel.with_vocab_over_stage(rules, cfg)
        check_mesh_axes(config, mesh, rules)
        n_batch_shards = parallel.shards(mesh, rules, "batch")
        if (config.batch_size // config.grad_accum_steps) % n_batch_shards:
            raise ValueError(
                f"the micro-batch of {config.batch_size // config.grad_accum_steps} sequences cannot be split over "
                f"{n_batch_shards} batch shards of mesh {dict(mesh.shape)}; use a batch_size divisible by {n_batch_shards * config.grad_accum_steps}"
            )
        _check_validation_batches(config, cfg, mesh)
        replica_axis = config.get("replicas") or None
        parallel.check(cfg, mesh, rules, batch=config.batch_size // config.grad_accum_steps, seq_len=config.data.seq_len, replicas=replica_axis or "")
        _check_attention_platform(config, mesh)
        _check_replicas_named(config, mesh)
        if replica_axis:
            _check_replica_kernels(config, mesh)
        balancing(config)  # checked here so a bad value is a usage error
        model_def = model_lib.define(cfg)
        # The fused quantized-state kernel runs per shard of these specs (optim.quantize_state).
        param_shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
        param_specs = fp8.split(jax.tree.map(lambda s: s.spec, param_shardings))[0]  # the optimizer never sees FP8 scaling state
        optimizer = build.make_spec(config.optimizer, config.steps, replica_axis=replica_axis, param_specs=param_specs)
        tx = build.transform(optimizer, config.optimizer, config.steps, replica_axis=replica_axis, param_specs=param_specs)
        if fp8.has_state(cfg):
            tx = fp8.exclude_scaling(tx)
        shardings = train_lib.make_shardings(model_def, tx, mesh, rules, replica_axis)
        optimizer.check_layout(*(fp8.split(t)[0] for t in (model_def.abstract_params, shardings.params)), replica_axis)
    except (ValueError, KeyError) as e:
        raise UsageError(_message(e)) from e
    return RunSpec(cfg, model_def, tx, mesh, rules, shardings)


# ------------------------------------------------------------------------------ values and mesh axes
# Checks of single values and of the mesh's axis names, kept apart from the parallel modes' checks.

# Config keys that count something: each must be >= 1 (``>= 0`` for the second table).
POSITIVE_KEYS = (
    "steps", "batch_size", "grad_accum_steps", "data.seq_len", "eval_every", "eval_batches", "log_every",
    "checkpoint_every", "keep_checkpoints", "max_bad_steps", "model.vocab_size", "model.d_model", "model.n_layers",
    "model.n_heads", "model.n_kv_heads", "model.head_dim", "model.mlp_dim", "model.max_seq_len",
)  # fmt: skip
# The loss weights and the clipping norm too: a negative one would ascend what it penalises (0 turns each off).
NON_NEGATIVE_KEYS = (
    "devices", "data.val_tokens", "optimizer.warmup_steps", "optimizer.grad_clip_norm", "loss.z_loss",
    "moe.balance_loss", "moe.router_z_loss", "moe.bias_rate",
)  # fmt: skip


def _lookup(config: ml_collections.ConfigDict, key: str) -> Any:
    """``config``'s value at the dotted ``key``; None where a config has no such key."""
    for part in key.split("."):
        if not isinstance(config, ml_collections.ConfigDict | dict) or part not in config:
            return None
        config = config[part]
    return config


def _check_validation_batches(config: ml_collections.ConfigDict, cfg: model_config_lib.ModelConfig, mesh: jax.sharding.Mesh) -> None:
    """A validation set of partial batches (``data.val_tokens`` not a multiple of a batch's targets) is scored with
    per-target weights over the whole vocabulary, which a vocabulary split over the stages does not hold."""
    per_batch = config.batch_size * config.data.seq_len
    if cfg.pipeline_vocab_parallel and mesh.shape.get(axes.STAGE, 1) > 1 and config.data.val_tokens % per_batch:
        whole = sorted({n for n in (per_batch * (config.data.val_tokens // per_batch), per_batch * -(-config.data.val_tokens // per_batch)) if n})
        raise ValueError(
            f"data.val_tokens={config.data.val_tokens} is not whole batches of {config.batch_size} x {config.data.seq_len} targets, "
            f"and a partial batch is scored over the whole vocabulary, which model.pipeline_vocab_parallel splits over the "
            f"stages; set data.val_tokens to a multiple of {per_batch} (e.g. {' or '.join(map(str, whole))})"
        )


def check_values(config: ml_collections.ConfigDict) -> None:
    """Sizes and counts in range (`POSITIVE_KEYS`, `NON_NEGATIVE_KEYS`), before anything divides by them.

    Raises:
      ValueError: naming the first key out of range and its bound.
    """
    for keys, low in ((POSITIVE_KEYS, 1), (NON_NEGATIVE_KEYS, 0)):
        for key in keys:
            value = _lookup(config, key)
            if value is not None and not isinstance(value, bool) and value < low:
                raise ValueError(f"config.{key}={value} must be >= {low}")


def check_mesh_axes(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, rules: rules_lib.Rules) -> None:
    """Every mesh axis of more than one device is used (by a rule or as ``config.replicas``): an unused one
    would run the same work on each of its devices. Every mesh axis a rule override names is in the mesh
    (an optional ``axis?`` may be absent).

    Raises:
      ValueError: naming the axis, the mesh and the fix.
    """
    used = {axis.rstrip(rules_lib.OPTIONAL) for table in (rules.params, rules.activations) for _, axes in table for axis in axes}
    if config.get("replicas"):
        used.add(config.replicas)
    for name, size in mesh.shape.items():
        if size > 1 and name not in used:
            raise ValueError(
                f"mesh axis {name!r} ({size} devices) is used by no rule of --config.rules={config.rules}, so its devices "
                f"would all do the same work; name an axis the rules use ({', '.join(sorted(used))}) or map a logical "
                f"axis to it with --config.rule_overrides (e.g. mlp={name})"
            )
    for key, value in rules_lib.parse_overrides(config.get("rule_overrides", "")).items():
        for axis in filter(None, value.split("+")):
            if not axis.endswith(rules_lib.OPTIONAL) and axis not in mesh.shape:
                raise ValueError(
                    f"rule_overrides {key}={value}: mesh axis {axis!r} is not in mesh {dict(mesh.shape)}; add it to "
                    f"--config.mesh or name one of {', '.join(mesh.axis_names)}"
                )


def _message(error: Exception) -> str:
    """An error's message: a `KeyError`'s argument without the quotes ``str`` adds, anything else as is."""
    if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
        return error.args[0]
    return str(error)


# ------------------------------------------------------------------------------ the resolved config


def used_optimizers(optimizer: ml_collections.ConfigDict) -> list[str]:
    """The optimizer blocks a run reads: its ``name`` and a wrapper's ``inner``."""
    inner = build.inner_name(optimizer)
    return [optimizer.name] + ([inner] if inner else [])


def keep_used_optimizers(optimizer: ml_collections.ConfigDict) -> None:
    """Removes from ``optimizer`` (unlocked) every family block the run does not read, and adds the blocks
    it reads that are missing (with their defaults), so a written config shows exactly those."""
    used = used_optimizers(optimizer)
    for family in registry.OPTIMIZERS:
        if family not in used and family in optimizer:
            del optimizer[family]
    for family in used:
        if family not in optimizer:
            optimizer[family] = ml_collections.ConfigDict(spec_lib.config_defaults(registry.spec_class(family)))


def _absolute(patterns: str, *, weighted: bool = False) -> str:
    """Comma-separated paths or globs (``GLOB:weight`` when ``weighted``) with each path made absolute."""
    parts = []
    for part in filter(None, (p.strip() for p in patterns.split(","))):
        path, weight = part.rsplit(":", 1) if weighted and ":" in part else (part, None)
        path = os.path.abspath(os.path.expanduser(path))
        parts.append(path if weight is None else f"{path}:{weight}")
    return ",".join(parts)


def resolve(config: ml_collections.ConfigDict, cfg: model_config_lib.ModelConfig) -> ml_collections.ConfigDict:
    """The config as the run ``build_run(config)`` uses it, every default filled in: enough to repeat it.

    The optimizer's learning rate, weight decay (where it has one) and warmup take their resolved values
    and only the blocks of the optimizers the run reads are kept; ``model`` holds every field of ``cfg``
    (the preset's shapes, the vocabulary from the shards); ``data`` the separator, the tokenizer and every
    path made absolute, so the config works from any folder. ``config`` is left as it is.

    Raises:
      ValueError: ``data.tokenizer`` is set and is not the tokenizer the shards were written with.
    """
    out = copy.deepcopy(config)
    out.unlock()
    opt = out.optimizer
    keep_used_optimizers(opt)
    direction = registry.spec_class(build.inner_name(opt) or opt.name)
    if opt.get("learning_rate") is None:
        opt.learning_rate = float(spec_lib.defaults(direction)["learning_rate"])
    if opt.get("weight_decay") is None and direction.applies_weight_decay:
        # the cautious decay replaces the uniform one (optim.build), so the run's weight decay is 0
        cautious = float(opt.get("cautious_weight_decay") or 0.0)
        opt.weight_decay = 0.0 if cautious else float(spec_lib.defaults(direction)["weight_decay"])
    if opt.get("warmup_steps") is None:
        opt.warmup_steps = schedules.default_warmup(out.steps)
    for key, value in dataclasses.asdict(cfg).items():
        out.model[key] = list(value) if isinstance(value, tuple) else value
    data = out.data
    if data.get("path"):
        data.path = _absolute(data.path)
    for key in ("train_files", "val_files"):
        if data.get(key):
            data[key] = _absolute(data[key])
    if data.get("mixture"):
        data.mixture = _absolute(data.mixture, weighted=True)
    if out.get("init_from_hf"):
        out.init_from_hf = _absolute(out.init_from_hf)
    data.separator_id = input_pipeline.separator_id(data_config(out))
    manifest = input_pipeline.train_manifest(data_config(out))
    written_with = "bytes" if manifest is None else str(manifest.get("tokenizer") or "")
    if data.get("tokenizer") and data.tokenizer != written_with:
        sha = None if manifest is None else manifest.get("tokenizer_sha256")
        if sha is None or tokenizer_lib.load(data.tokenizer).fingerprint != sha:
            raise ValueError(
                f"data.tokenizer={data.tokenizer} is not the tokenizer the training data was written with "
                f"({written_with or 'unnamed'}); leave data.tokenizer empty or give that tokenizer"
            )
    else:
        data.tokenizer = written_with
    return out
