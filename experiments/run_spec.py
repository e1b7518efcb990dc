"""Building a run from its config: the model, the optimizer, the mesh and every sharding, checked.

`build_run` turns a config (``experiments/configs/default.py``) into a `RunSpec` (no data, no
allocation) and reports every bad input as a `UsageError`; every entry point (training, sampling,
benchmarks, the planner) builds its run here. `run_meta` is what a checkpoint must agree with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections

from experiments import train_lib
from experiments.cli import UsageError
from lm import config as model_config_lib
from lm import hf
from lm import model as model_lib
from lm import moe
from lm.data import input_pipeline
from lm.parallel import check as parallel
from optim import build, registry
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

# Common optimizer keys that change the optimizer state's structure.
STATE_SHAPING_KEYS = ("state_bits", "cautious")

# Model fields a resumed run may change: they alter how the step computes, not what the state is.
_RESUMABLE_MODEL_CHANGES = (
    "attention", "dtype", "remat", "scan_unroll", "track_attn_logits",
    "context_parallel", "pipeline_schedule", "pipeline_microbatches", "pipeline_repeats",
)  # fmt: skip


def data_config(config: ml_collections.ConfigDict) -> input_pipeline.DataConfig:
    """The `DataConfig` of ``config.data`` (defaults for keys an older run's config lacks)."""
    return input_pipeline.DataConfig(**config.data.to_dict())


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
    """The model of the transformers checkpoint ``config.init_from_hf``; ``config.model`` may set only how it
    computes (``dtype``, ``remat``, ``scan_layers``, ...), an architecture field that differs is an error."""
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
    if conflicts:
        raise ValueError(f"init_from_hf={directory} fixes the architecture, but the config sets {', '.join(conflicts)}; drop those keys")
    computes = {k: v for k, v in overrides.items() if k not in hf.CONFIG_FIELDS}
    return hf.read_config(directory, **computes, document_separator=input_pipeline.document_separator(data_config(config)))


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
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _RESUMABLE_MODEL_CHANGES}
    meta = {"replicas": {"axis": config.replicas, "count": replicas}} if config.get("replicas") else {}
    return meta | {
        "model": model,
        "optimizer": {
            "name": name,
            **family,
            **{k: config.optimizer[k] for k in STATE_SHAPING_KEYS if k in config.optimizer},
        },
    }


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
        if config.steps < 1:
            raise ValueError(f"config.steps={config.steps} must be >= 1")
        if config.grad_accum_steps < 1 or config.batch_size % config.grad_accum_steps:
            raise ValueError(f"batch_size={config.batch_size} must be a multiple of grad_accum_steps={config.grad_accum_steps}")
        cfg = model_config(config)
        if "attn_max_logits" in registry.spec_class(config.optimizer.name).extra_args:
            cfg = dataclasses.replace(cfg, track_attn_logits=True)
        if config.data.seq_len > cfg.max_seq_len:
            raise ValueError(f"data.seq_len={config.data.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        if config.devices and jax.process_count() > 1:
            raise ValueError("config.devices selects local devices and works only in single-process runs; leave it 0")
        if config.devices > len(jax.devices()):
            raise ValueError(f"config.devices={config.devices} but only {len(jax.devices())} devices are present")
        mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[: config.devices] if config.devices else None)
        rules = rules_lib.make_rules(config.rules, rules_lib.parse_overrides(config.get("rule_overrides", "")))
        n_batch_shards = parallel.shards(mesh, rules, "batch")
        if (config.batch_size // config.grad_accum_steps) % n_batch_shards:
            raise ValueError(
                f"the micro-batch of {config.batch_size // config.grad_accum_steps} sequences cannot be split over "
                f"{n_batch_shards} batch shards of mesh {dict(mesh.shape)}; use a batch_size divisible by {n_batch_shards * config.grad_accum_steps}"
            )
        replica_axis = config.get("replicas") or None
        parallel.check(cfg, mesh, rules, batch=config.batch_size // config.grad_accum_steps, seq_len=config.data.seq_len, replicas=replica_axis or "")
        _check_replicas_named(config, mesh)
        if replica_axis:
            _check_replica_kernels(config, mesh)
        balancing(config)  # checked here so a bad value is a usage error
        model_def = model_lib.define(cfg)
        # The fused quantized-state kernel runs per shard of these specs (optim.quantize_state).
        param_shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
        param_specs = jax.tree.map(lambda s: s.spec, param_shardings)
        optimizer = build.make_spec(config.optimizer, config.steps, replica_axis=replica_axis, param_specs=param_specs)
        tx = build.transform(optimizer, config.optimizer, replica_axis=replica_axis, param_specs=param_specs)
        shardings = train_lib.make_shardings(model_def, tx, mesh, rules, replica_axis)
        optimizer.check_layout(model_def.abstract_params, shardings.params, replica_axis)
    except (ValueError, KeyError) as e:
        raise UsageError(str(e).strip("'\"")) from e
    return RunSpec(cfg, model_def, tx, mesh, rules, shardings)
