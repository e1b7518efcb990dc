r"""Collective bytes per training step of the matrix optimizers next to AdamW, from the compiled HLO.

    python -m experiments.bench_optimizer_comm --json_out=/tmp/opt_comm.json
    python -m experiments.bench_optimizer_comm --rows=adamw,dion_r8 --meshes=fsdp:8

Each row is `experiments.train`'s step for one optimizer on a GSPMD mesh (``fsdp:8``: ZeRO-3;
``fsdp:4,tensor:2``: ZeRO-3 with Megatron tensor parallelism, rules ``tp``), compiled, never run.
Collectives are counted by `experiments.hlo_bytes` (payload and ring bytes per
device, loops multiplied; a conditional branch once per ``H`` steps, where ``H`` is the row's
``sync_every``, 1 here: none of these optimizers branches on its step). AdamW's bytes are the
data-parallel floor: the gradient reduction and the parameter all-gathers that the sharded
forward and backward passes need. An optimizer that gathers a whole matrix (Newton-Schulz,
a QR) adds that on top; one that works on r-wide factors adds ``O((m + n) r)`` per matrix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import ml_collections
from absl import app, flags

from experiments import cli, hlo_bytes

ROWS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer.name": "adamw"},
    "muon": {"optimizer.name": "muon"},  # ns_sharding="auto"
    "normuon": {"optimizer.name": "normuon"},
    "dion_r8": {"optimizer.name": "dion", "optimizer.dion.rank_fraction": 0.125},  # r = d/8
    "dion_r4": {"optimizer.name": "dion"},  # the default, r = d/4
    "dion2": {"optimizer.name": "dion2"},  # fraction 1/4, selection_scope="global"
    "dion2_local": {"optimizer.name": "dion2", "optimizer.dion2.selection_scope": "local"},
    "muon_as_is": {"optimizer.name": "muon", "optimizer.muon.ns_sharding": "as_is"},
    "muon_owner": {"optimizer.name": "muon", "optimizer.muon.ns_sharding": "owner"},
    "muon_replicated": {"optimizer.name": "muon", "optimizer.muon.ns_sharding": "replicated"},
}
MESHES = {"fsdp:8": "fsdp", "fsdp:4,tensor:2": "tp"}  # mesh -> rule preset


def row_config(name: str, mesh: str, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(base.to_dict())
    config.mesh, config.rules, config.replicas = mesh, MESHES[mesh], ""
    config.update_from_flattened_dict(ROWS[name])
    return config


def measure(name: str, mesh: str, base: ml_collections.ConfigDict) -> dict[str, Any]:
    config = row_config(name, mesh, base)
    found = hlo_bytes.collectives(hlo_bytes.compiled_hlo(config), jax.device_count())
    tokens = config.batch_size * config.data.seq_len
    by_kind: dict[str, float] = {}
    for c in found:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.payload * c.count
    return {"row": name, "mesh": mesh, "payload_by_kind": by_kind, **hlo_bytes.summarize(found, 1, tokens)}


def print_table(results: list[dict[str, Any]]) -> None:
    print("| mesh | row | payload B/step | ring B/step | vs AdamW (payload) | vs AdamW (ring) | payload by kind |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        base = next((b for b in results if b["row"] == "adamw" and b["mesh"] == r["mesh"]), None)
        ratio = {m: "" if base is None else f"{r[m]['per_step'] / base[m]['per_step']:.2f}x" for m in ("payload", "ring")}
        kinds = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["payload_by_kind"].items()))
        print(
            f"| {r['mesh']} | {r['row']} | {r['payload']['per_step']:,.0f} | {r['ring']['per_step']:,.0f} | "
            f"{ratio['payload']} | {ratio['ring']} | {kinds} |"
        )


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv
    cli.quiet_logging(flags.FLAGS.verbose)
    names = [n.strip() for n in flags.FLAGS.rows.split(",")] if flags.FLAGS.rows != "all" else list(ROWS)
    meshes = [m.strip() for m in flags.FLAGS.meshes.split(";")]
    unknown = [n for n in names if n not in ROWS] + [m for m in meshes if m not in MESHES]
    if unknown:
        cli.usage_exit(f"unknown row(s) or mesh(es) {unknown}; rows: {', '.join(ROWS)}; meshes: {'; '.join(MESHES)}")
    results = []
    for mesh in meshes:
        for name in names:
            try:
                results.append(measure(name, mesh, config_flag.value))
            except cli.UsageError as e:
                cli.usage_exit(f"row {name} on {mesh}: {e}")
            print(json.dumps({k: results[-1][k] for k in ("row", "mesh", "payload", "ring")}), file=sys.stderr, flush=True)
    print_table(results)
    if flags.FLAGS.json_out:
        Path(flags.FLAGS.json_out).write_text(json.dumps(results, indent=2))


def define_flags() -> flags.FlagHolder:
    flags.DEFINE_string("rows", "all", f"Comma-separated rows: {', '.join(ROWS)}, or 'all'.")
    flags.DEFINE_string("meshes", ";".join(MESHES), f"Semicolon-separated meshes: {'; '.join(MESHES)}.")
    cli.define_cpu_devices_flag(8)
    flags.declare_key_flag("cpu_devices")
    cli.define_output_file_flag("json_out", "Write the results here as JSON.")
    cli.define_verbose_flag()
    return cli.define_config_flag(str(Path(__file__).parent / "configs" / "bench_comm.py"))


if __name__ == "__main__":
    holder = define_flags()

    def _main(argv):
        cli.split_cpu_devices()
        main(holder, argv)

    app.run(_main, flags_parser=cli.parse_flags)
