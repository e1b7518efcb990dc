r"""Trains a language model.

    python -m experiments.train --workdir=runs/tiny --config=experiments/configs/default.py \
        --config.steps=300 --config.model.preset=tiny --config.optimizer.name=adamw \
        --config.optimizer.learning_rate=3e-3 --config.seed=0

``--config=runs/x/config.json`` repeats a run from the config it wrote; ``--list_config`` prints
every ``--config.<key>`` with its value and help. With no flags it runs the default job (`tiny` +
AdamW on the standard-library corpus) into a fresh workdir under ``./runs/``. A workdir that holds checkpoints is resumed from the latest one (from an
earlier one with ``--restore_step=N``, e.g. when the latest is damaged).
Writes ``config.json``, ``metrics.jsonl``, TensorBoard events, ``loss.png``, checkpoints and
``summary.json`` into the workdir. The run itself is `experiments.trainer.run`; this module is only
its command line and is imported by nothing.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
from absl import app, flags

from experiments import cli, host_memory, trainer
from experiments.configs import help as config_help


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv  # checked by cli.parse_flags
    host_memory.keep_freed_memory()  # before JAX starts its backend
    cli.split_cpu_devices()
    cli.quiet_logging(flags.FLAGS.verbose)
    cli.start_processes()
    config = config_flag.value
    if flags.FLAGS.list_config:
        print(config_help.listing(config))
        return
    try:
        workdir = flags.FLAGS.workdir or cli.fresh_workdir(f"{config.model.preset}-{config.optimizer.name}", jax.process_count())
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    if not flags.FLAGS.workdir:
        print(f"workdir: {workdir} (a fresh one; pass --workdir={workdir} to resume it)", file=sys.stderr)
    try:
        summary = trainer.run(config, workdir, interrupt_at=flags.FLAGS.stop_after, restore_step=flags.FLAGS.restore_step)
    except cli.UsageError as e:
        if flags.FLAGS.verbose:
            raise
        cli.usage_exit(str(e))
    except trainer.NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if summary.get("interrupted"):
        print(f"workdir: {workdir}", file=sys.stderr)
        sys.exit(128 + summary["signal"])
    if summary.get("finished"):
        print(f"workdir: {workdir}")
        return
    keys = (
        "steps", "final_train_loss", "final_val_loss", "final_val_bits_per_byte", "tokens_per_second",
        "mfu", "mfu_peak_source", "mfu_measured_matmul", "mesh",
    )  # fmt: skip
    print(json.dumps({k: summary[k] for k in keys}))
    print(f"workdir: {workdir}")


def define_flags() -> flags.FlagHolder:
    """The command-line flags; config overrides of unknown keys exit with code 2."""
    cli.define_output_folder_flag("workdir", None, "Output folder; default: a fresh folder under ./runs/.")
    cli.define_verbose_flag()
    cli.define_cluster_flags()
    cli.define_cpu_devices_flag()
    flags.DEFINE_integer("stop_after", None, "Stop as if preempted after this step (checkpoint, exit 143).")
    flags.DEFINE_integer("restore_step", None, "Resume from this checkpoint step, not the newest; newer ones are deleted.")
    flags.DEFINE_bool("list_config", False, "Print every --config.<key> with its value and a line of help, then exit.")
    config = cli.define_config_flag(cli.DEFAULT_CONFIG)
    cluster_flags = ("coordinator_address", "num_processes", "process_id", "local_device_ids", "cluster", "initialization_timeout", "heartbeat_timeout")
    for name in ("config", "verbose", "cpu_devices", *cluster_flags):  # defined in experiments.cli; listed by --help as this script's own
        flags.declare_key_flag(name)
    return config


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=cli.parse_flags)
