r"""Bytes on the wire per training step, read from the compiled HLO, next to the loss each method reaches.

    python -m experiments.bench_comm --cpu_devices=8 --config.steps=300 --json_out=/tmp/comm.json
    python -m experiments.bench_comm --rows=adamw,demo --train=false   # bytes only

Each row is a real training step of `experiments.train` on a ``data:8`` mesh (8 replicas): AdamW
data parallelism under GSPMD, and the replica-local step (``--config.replicas=data``) with DeMo,
DiLoCo (H = 10, 50, 500), Streaming DiLoCo, PowerSGD (r = 1, 4), NoLoCo (H = 50), DES-LOC (K_x = 32,
K_u = 96, K_v = 192), Local Adam (DES-LOC with every period 32) and MT-DAO (every period 32). The step is compiled and every
collective of the optimised HLO module is counted by `experiments.hlo_bytes` (payload and ring bytes,
``while`` trip counts, one branch per ``conditional`` amortised over ``H`` or a ``sync_period_K`` scope);
per token divides by the tokens of one step (all replicas).

With ``--train`` each row also trains ``tiny`` for ``--config.steps`` steps (300 in its config; the same data,
batch, schedule and seed for every row) and reports the final validation loss.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import ml_collections
from absl import app, flags

from experiments import cli, hlo_bytes, trainer

# name -> config overrides; "sync_every" is H for the amortisation of conditional collectives.
ROWS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer.name": "adamw", "replicas": ""},
    "demo": {"optimizer.name": "demo", "optimizer.learning_rate": 1e-3},
    "demo_lr3e-4": {"optimizer.name": "demo", "optimizer.learning_rate": 3e-4},
    "demo_lr3e-3": {"optimizer.name": "demo", "optimizer.learning_rate": 3e-3},
    "demo_lr3e-3_b0.99_top64": {
        "optimizer.name": "demo", "optimizer.learning_rate": 3e-3, "optimizer.demo.beta": 0.99, "optimizer.demo.topk": 64,
    },
    "demo_bf16_int16": {
        "optimizer.name": "demo", "optimizer.learning_rate": 1e-3, "optimizer.demo.value_dtype": "bfloat16",
        "optimizer.demo.index_dtype": "int16",
    },
    "diloco_h10": {"optimizer.name": "diloco", "optimizer.diloco.sync_every": 10},
    "diloco_h50": {"optimizer.name": "diloco", "optimizer.diloco.sync_every": 50},
    "diloco_h500": {"optimizer.name": "diloco", "optimizer.diloco.sync_every": 500},
    "streaming_diloco_h50": {
        "optimizer.name": "streaming_diloco", "optimizer.streaming_diloco.sync_every": 50,
        "optimizer.streaming_diloco.fragments": 4, "optimizer.streaming_diloco.overlap": 1,
        "optimizer.streaming_diloco.mixing": 0.5, "optimizer.streaming_diloco.exchange": "int4",
    },
    "powersgd_r1": {"optimizer.name": "powersgd", "optimizer.powersgd.rank": 1},
    "powersgd_r4": {"optimizer.name": "powersgd", "optimizer.powersgd.rank": 4},
    "noloco_h50": {"optimizer.name": "noloco", "optimizer.noloco.sync_every": 50},
    "des_loc_k32": {"optimizer.name": "des_loc"},  # K_x = 32, K_u = 96, K_v = 192
    "local_adam_k32": {
        "optimizer.name": "des_loc", "optimizer.des_loc.mu_sync_every": 32, "optimizer.des_loc.nu_sync_every": 32,
    },
    "mt_dao_k32": {"optimizer.name": "mt_dao"},  # K_x = K_u = K_v = 32, slow b1 = 0.999, omega = 0.7
}  # fmt: skip


def row_config(name: str, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(base.to_dict())
    config.replicas = "data"
    config.update_from_flattened_dict(ROWS[name])
    return config


def sync_every(config: ml_collections.ConfigDict) -> int:
    family = config.optimizer.get(config.optimizer.name) or {}
    return int(family.get("sync_every", 1))


def measure_row(name: str, base: ml_collections.ConfigDict, *, train_run: bool, workdir: Path) -> dict[str, Any]:
    config = row_config(name, base)
    tokens = config.batch_size * config.data.seq_len
    found = hlo_bytes.collectives(hlo_bytes.compiled_hlo(config), jax.device_count())
    result = {"row": name, "sync_every": sync_every(config), **hlo_bytes.summarize(found, sync_every(config), tokens)}
    if train_run:
        summary = trainer.run(config, workdir / name)
        result |= {"final_val_loss": summary["final_val_loss"], "final_train_loss": summary["final_train_loss"]}
    return result


def print_table(results: list[dict[str, Any]], baseline: str = "adamw") -> None:
    base = next((r for r in results if r["row"] == baseline), None)
    header = "| row | H | payload B/step | payload B/token | ring B/step | ring B/token | vs AdamW (payload / ring) | val loss | vs AdamW |"
    print(header)
    print("|" + " --- |" * header.count(" | ") + " --- |")
    for r in results:
        ratio = "" if base is None else f"1/{base['payload']['per_step'] / r['payload']['per_step']:.0f} / 1/{base['ring']['per_step'] / r['ring']['per_step']:.0f}"
        loss = r.get("final_val_loss")
        rel = "" if base is None or loss is None or base.get("final_val_loss") is None else f"{100 * (loss / base['final_val_loss'] - 1):+.1f}%"
        print(
            f"| {r['row']} | {r['sync_every']} | {r['payload']['per_step']:,.0f} | {r['payload']['per_token']:,.1f} | "
            f"{r['ring']['per_step']:,.0f} | {r['ring']['per_token']:,.1f} | {ratio} | {'' if loss is None else f'{loss:.4f}'} | {rel} |"
        )


def main(config_flag, argv: list[str]) -> None:
    del argv
    cli.quiet_logging(flags.FLAGS.verbose)
    base = config_flag.value
    names = list(ROWS) if flags.FLAGS.rows == "all" else [n.strip() for n in flags.FLAGS.rows.split(",")]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        cli.usage_exit(f"unknown row(s) {unknown}; rows: {', '.join(ROWS)}")
    workdir = Path(flags.FLAGS.workdir or tempfile.mkdtemp(prefix="bench_comm-"))
    results = []
    for name in names:
        try:
            results.append(measure_row(name, base, train_run=flags.FLAGS.train, workdir=workdir))
        except cli.UsageError as e:
            cli.usage_exit(f"row {name}: {e}")
        print(json.dumps({k: results[-1][k] for k in ("row", "payload", "ring") } | {"val": results[-1].get("final_val_loss")}), file=sys.stderr, flush=True)
    print_table(results)
    if flags.FLAGS.json_out:
        Path(flags.FLAGS.json_out).write_text(json.dumps(results, indent=2))


def define_flags() -> flags.FlagHolder:
    flags.DEFINE_string("rows", "all", f"Comma-separated rows: {', '.join(ROWS)}, or 'all'.")
    flags.DEFINE_bool("train", True, "Also train each row and report its final validation loss.")
    cli.define_cpu_devices_flag(8)
    flags.declare_key_flag("cpu_devices")
    cli.define_output_folder_flag("workdir", "", "Where the training runs go (default: a fresh temporary folder).")
    cli.define_output_file_flag("json_out", "Write the results here as JSON.")
    cli.define_verbose_flag()
    return cli.define_config_flag(str(Path(__file__).parent / "configs" / "bench_comm.py"))


if __name__ == "__main__":
    holder = define_flags()

    def _main(argv):
        cli.split_cpu_devices()
        # Each row's step is compiled for its HLO and again by the training run: let the second one hit a cache.
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="bench_comm-xla-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        main(holder, argv)

    app.run(_main, flags_parser=cli.parse_flags)
