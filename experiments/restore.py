"""A finished run, read back from its workdir: its model and params from a checkpoint, its tokenizer.

The library behind the entry points that use a trained run (`experiments.sample`, `experiments.evaluate`,
`experiments.export_hf`): the run's ``config.json`` rebuilt by `experiments.run_spec`, its params restored
from an orbax checkpoint onto any mesh (`experiments.checkpointing`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections

from experiments import checkpointing, cli, run_spec, storage, train_lib
from experiments.configs import resolved
from lm import model as model_lib
from lm.data import input_pipeline, tokenizer
from optim.tail_average import evaluation_params
from sharding import partition

# What a run copies of its training data into its workdir (`experiments.trainer`), so its readers need
# nothing else: the shards' manifest, and the tokenizer file it names under one of these names.
DATA_MANIFEST = "data_manifest.json"
TOKENIZER_NAMES = {Path(name).suffix: name for name in tokenizer.FILE_NAMES}


def load_params(workdir: str | Path, step: int | None = None) -> tuple[model_lib.ModelDef, model_lib.Params, int]:
    """``(model_def, params, step)`` of checkpoint ``step`` (default: the newest) of the run in ``workdir``, on one device."""
    spec, params, saved_step = restore_run(workdir, step)
    return spec.model_def, params, saved_step


def restore_run(workdir: str | Path, step: int | None = None, *, mesh: str = "", devices: int = 1):
    """``(run_spec.RunSpec, params, step)``: the run in ``workdir`` rebuilt on ``mesh`` over ``devices``
    (0: all), its params restored from checkpoint ``step`` (default: the newest) into the run's shardings.

    The params are those the run evaluates: tail-averaged where it kept an average, and in a replica-local
    run (``config.replicas``) the mean over its replicas, read on any mesh whatever the replica count."""
    workdir = storage.workdir(workdir)
    config = run_config(workdir)
    config.mesh, config.devices = mesh, devices  # checkpoints restore onto any mesh
    spec = run_spec.build_run(config)
    if not (workdir / "checkpoints").is_dir():
        raise cli.UsageError(f"{workdir} holds no checkpoints; train longer than checkpoint_every steps or pick another run")
    mgr = checkpointing.manager(workdir, keep=config.keep_checkpoints, every=config.checkpoint_every)
    try:
        replicas = _saved_replicas(mgr, step) if spec.shardings.replica_axis else 1
        with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
            target = train_lib.abstract_state(spec.model_def, spec.tx, spec.shardings, replicas=replicas)
            restored = checkpointing.restore(
                mgr, target, run_spec.run_meta(config, spec.cfg, replicas), step, discard_newer=False, upgrade=run_spec.upgrade_meta
            )
    except checkpointing.CheckpointError as e:
        raise cli.UsageError(str(e)) from e
    finally:
        mgr.close()
    if restored is None:
        raise cli.UsageError(f"{workdir} holds no finished checkpoint; train longer than checkpoint_every steps")
    saved_step, state, _ = restored
    params = evaluation_params(state["params"], state["opt_state"])  # tail-averaged where the run kept one
    if spec.shardings.replica_axis:  # as the run evaluates them (`train_lib.jit_eval_step`)
        mean = jax.jit(lambda p: jax.tree.map(lambda x: jnp.mean(x, axis=0), p), out_shardings=spec.shardings.params)
        params = mean(params)
    return spec, params, saved_step


def _saved_replicas(mgr, step: int | None) -> int:
    """The replica count of a replica-local run's checkpoint ``step`` (default: the newest), from its meta."""
    steps = mgr.all_steps()
    chosen = step if step is not None else (steps[-1] if steps else None)
    if chosen is None or chosen not in steps:
        return 1  # `checkpointing.restore` names the missing step
    meta = run_spec.upgrade_meta(checkpointing.read_meta(mgr, chosen))
    return int(meta.get("replicas", {}).get("count", 1))


def load_tokenizer(workdir: str | Path, spec: str | None = None) -> tokenizer.Tokenizer:
    """The tokenizer ``spec`` names, else the one the run in ``workdir`` trained with: its copy in the workdir,
    or for runs that made none, the one its shards' manifest names (`input_pipeline.run_tokenizer`)."""
    try:
        if spec:
            return tokenizer.load(spec)
        manifest = run_manifest(workdir)
        if manifest is not None and manifest.get("tokenizer_copy"):
            tok = tokenizer.load(manifest["tokenizer"])
            if manifest.get("tokenizer_sha256") not in (None, tok.fingerprint):
                raise ValueError(f"{manifest['tokenizer']} changed since the run copied it (sha256 differs from the manifest's)")
            return tok
        return input_pipeline.run_tokenizer(run_spec.data_config(run_config(workdir)))
    except ValueError as e:
        raise cli.UsageError(f"{e} (--tokenizer=FILE)") from e


def run_config(workdir: str | Path) -> ml_collections.ConfigDict:
    """The resolved config the run in ``workdir`` wrote (its ``config.json``)."""
    path = storage.workdir(workdir) / "config.json"
    if not path.is_file():
        raise cli.UsageError(f"{path} does not exist; pass the --workdir of a training run")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise cli.UsageError(f"{path} is not the JSON object a run writes ({e}); restore it from the run or train again") from e
    if isinstance(config, dict) and "architectures" in config:
        raise cli.UsageError(
            f"{path} is a transformers checkpoint's config, not a training run's: --workdir takes a run's folder "
            "(evaluate --hf and --config.init_from_hf read an export)"
        )
    if not resolved.is_run_config(config):
        raise cli.UsageError(f"{path} is not a run's config, without the model, data and optimizer blocks a run writes; restore it from the run or train again")
    return ml_collections.ConfigDict(config)


def run_manifest(workdir: str | Path) -> dict | None:
    """The training shards' manifest of the run in ``workdir`` (None for the text corpus or shards without one):
    the run's copy (its ``tokenizer`` then the workdir's copy of the tokenizer), else the shards' own."""
    path = storage.workdir(workdir) / DATA_MANIFEST
    if not path.is_file():
        return input_pipeline.train_manifest(run_spec.data_config(run_config(workdir)))
    manifest = json.loads(path.read_text())
    if manifest.get("tokenizer_copy"):
        manifest["tokenizer"] = str(storage.workdir(workdir) / manifest["tokenizer_copy"])
    return manifest
