r"""Pipeline schedules measured: bubble, per-device memory, stage-to-stage bytes, and exactness.

    python -m experiments.bench_pipeline --json_out=/tmp/pipeline.json

On ``--devices`` fake CPU devices (default 8), for the `tiny` model with ``n_layers=8``:

- **bubble**: the share of idle (tick, stage) entries of each schedule's own tick table
  (`lm.parallel.pipeline.forward_table`, `lm.parallel.pipeline_schedule.tick_table`) next to its formula;
- **memory**: `compiled.memory_analysis()` of the whole train step on ``stage:4,data:2`` at
  ``M = 4, 8, 16``: temporaries per device (the activations a schedule keeps live among them);
- **stage-to-stage bytes**: the collective-permutes of the compiled step (`experiments.hlo_bytes`'s
  HLO counting: payload per execution and executions per step), next to one microbatch's activations
  and the schedule's tick count;
- **exactness**: ``--steps`` steps of AdamW and Muon on ``stage:4,data:2`` and
  ``stage:2,fsdp:2,tensor:2`` against one device, the largest relative loss difference;
- **vocab**: vocabulary parallelism (`lm.parallel.vocab_parallel`) off and on, every schedule on
  ``stage:4,data:2`` at ``--vocab_size``: parameter bytes per device (from the shardings), the compiled
  step's arguments and temporaries per device, and the LM head's FLOPs per step on each stage;
- **skip**: SkipPipe's tick tables (`lm.parallel.skip_schedule`) at every allowed skip rate: ticks,
  bubble, throughput (microbatches per tick) and layer-group runs, for 4 and 8 stages.

``--sections`` picks among bubbles, memory, exactness, vocab, skip (default: all), e.g.

    python -m experiments.bench_pipeline --sections=vocab,skip --json_out=/tmp/pipeline_vocab_skip.json
"""

from __future__ import annotations

import json
import time

import jax
import ml_collections
import numpy as np
from absl import app, flags

from experiments import cli, hlo_bytes, run_spec, train_lib
from experiments.configs import default
from lm.parallel import pipeline, pipeline_schedule, skip_schedule
from sharding import cpu_devices, partition

SCHEDULES = ("gpipe", "circular", "1f1b", "zb_h1")
MESHES = (("stage:4,data:2", "fsdp"), ("stage:2,fsdp:2,tensor:2", "tp"))
OPTIMIZERS = ("adamw", "muon")

_FLAGS = flags.FLAGS
SECTIONS = ("bubbles", "memory", "exactness", "vocab", "skip")


def define_flags() -> None:
    """The command-line flags (defined under ``__main__`` only: scripts share absl's flag registry)."""
    flags.DEFINE_integer("devices", 8, "Fake CPU devices.")
    flags.DEFINE_integer("steps", 10, "Training steps of the exactness check; 0 skips it.")
    cli.define_int_list_flag("microbatches", [4, 8, 16], "Microbatch counts of the memory table (stage:4).")
    flags.DEFINE_integer("seq_len", 32, "Sequence length.")
    cli.define_output_file_flag("json_out", "Also write the results as JSON here.")
    flags.DEFINE_integer("vocab_size", 8192, "Vocabulary of the vocab section's model.")
    flags.DEFINE_list("sections", list(SECTIONS), f"Which tables to measure, from {', '.join(SECTIONS)}.")


def _config(mesh: str, rules: str, schedule: str, microbatches: int, *, batch: int, optimizer: str = "adamw") -> ml_collections.ConfigDict:
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = max(_FLAGS.steps, 1), batch, _FLAGS.seq_len
    config.model.update({
        "preset": "tiny", "n_layers": 8,
        "pipeline_schedule": schedule, "pipeline_microbatches": microbatches, "pipeline_repeats": 2 if schedule == "circular" else 1,
    })  # fmt: skip
    config.optimizer.name, config.optimizer.warmup_steps = optimizer, 1
    config.mesh, config.rules = mesh, rules
    if mesh == "data:1":
        config.devices = 1
    return config


def _compiled_step(config: ml_collections.ConfigDict):
    spec = run_spec.build_run(config)
    shardings = spec.shardings
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.abstract_state(spec.model_def, spec.tx, shardings)
        batch = jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len + 1), np.int32, sharding=shardings.batch)
        return spec, train_lib.jit_train_step(train_lib.make_train_step(spec.model_def, spec.tx), shardings).lower(state, batch).compile()


def _ticks(schedule: str, stages: int, m: int) -> int:
    """Ticks of the schedule's loop: one layer group per stage per tick (GPipe, circular: forward only)."""
    if schedule in pipeline_schedule.SCHEDULES:
        return pipeline_schedule.tick_table(schedule, stages, m)[0].shape[0]
    return pipeline.forward_table(stages, m, 2 if schedule == "circular" else 1).shape[0]


def bubbles(stages: int = 4) -> list[dict]:
    """Idle share of each schedule's tick table and its formula, at ``stages`` and several M.

    ZB-H1's formula, ``(S-1)/(3M+S-1)``, is the paper's bubble ``(S-1)(T_F + T_B - T_W)`` over a step
    of ``3M`` unit ops plus that bubble, with ``T_F = T_B = T_W``: a third of 1F1B's idle time.
    """
    rows = []
    for m in (4, 8, 16):
        for schedule in SCHEDULES:
            if schedule in pipeline_schedule.SCHEDULES:
                measured = pipeline_schedule.bubble_fraction(pipeline_schedule.tick_table(schedule, stages, m)[0])
                split = schedule == "zb_h1"
                formula = (stages - 1) / ((3 if split else 1) * m + stages - 1)
                text = "(S-1)/(3M+S-1)" if split else "(S-1)/(M+S-1)"
            else:
                r = 2 if schedule == "circular" else 1
                measured = pipeline.bubble_fraction(pipeline.forward_table(stages, m, r))
                formula, text = (stages - 1) / (r * m + stages - 1), f"(S-1)/({r}M+S-1)"
            rows.append({
                "schedule": schedule, "stages": stages, "microbatches": m, "bubble": measured, "formula": formula,
                "formula_text": text, "ticks": _ticks(schedule, stages, m), "one_f_one_b_formula": (stages - 1) / (m + stages - 1),
            })  # fmt: skip
    return rows


def memory_and_bytes() -> list[dict]:
    """Temporaries per device and stage-to-stage bytes of the compiled step on stage:4,data:2."""
    rows = []
    for m in (int(x) for x in _FLAGS.microbatches):
        batch = 2 * m  # two rows per microbatch: one per data shard
        for schedule in SCHEDULES:
            if schedule == "circular" and m < 4:
                continue
            config = _config("stage:4,data:2", "fsdp", schedule, m, batch=batch)
            spec, compiled = _compiled_step(config)
            memory = compiled.memory_analysis()
            permutes = [c for c in hlo_bytes.collectives(compiled.as_text(), spec.mesh.size) if c.kind == "collective-permute"]
            activation = (batch // m // 2) * config.data.seq_len * spec.cfg.d_model * 4  # one microbatch's shard, fp32
            rows.append({
                "schedule": schedule, "microbatches": m, "batch": batch,
                "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
                "permute_bytes_per_step": sum(c.payload * c.count for c in permutes),
                "permute_executions": sum(c.count for c in permutes),
                "permute_payloads": sorted({c.payload for c in permutes}),
                "microbatch_activation_bytes": activation, "ticks": _ticks(schedule, 4, m),
            })  # fmt: skip
            print(f"compiled {schedule} M={m}: temp {rows[-1]['temp_bytes'] / 2**20:.2f} MiB", flush=True)
    return rows


def _losses(config: ml_collections.ConfigDict, batches: np.ndarray) -> np.ndarray:
    spec = run_spec.build_run(config)
    shardings = spec.shardings
    losses = []
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.init_state(spec.model_def, spec.tx, 0, shardings)
        step = train_lib.jit_train_step(train_lib.make_train_step(spec.model_def, spec.tx), shardings)
        for tokens in batches:
            state, metrics = step(state, train_lib.global_batch(tokens, shardings))
            losses.append(float(metrics["loss"]))
    return np.array(losses)


def exactness() -> list[dict]:
    """Largest relative loss difference to one device over ``--steps`` train steps (the real train step)."""
    batch, m = 16, 4
    rng = np.random.default_rng(0)
    batches = rng.integers(0, 256, (_FLAGS.steps, batch, _FLAGS.seq_len + 1), dtype=np.int32)
    rows = []
    for optimizer in OPTIMIZERS:
        reference = _losses(_config("data:1", "fsdp", "gpipe", m, batch=batch, optimizer=optimizer), batches)
        for mesh, rules in MESHES:
            for schedule in SCHEDULES:
                losses = _losses(_config(mesh, rules, schedule, m, batch=batch, optimizer=optimizer), batches)
                error = float(np.max(np.abs(losses - reference) / np.abs(reference)))
                rows.append({"optimizer": optimizer, "mesh": mesh, "schedule": schedule, "microbatches": m, "max_rel_loss_diff": error,
                             "first_loss": float(losses[0]), "last_loss": float(losses[-1])})  # fmt: skip
                print(f"{optimizer} {mesh} {schedule}: max rel loss diff {error:.2e}", flush=True)
    return rows


def _bytes_per_device(shardings, abstract) -> int:
    """Bytes of one device's shards of the arrays ``abstract`` placed by ``shardings`` (the same on every device)."""
    leaves = zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract), strict=True)
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize for s, a in leaves)


def vocab_balance() -> list[dict]:
    """Vocabulary layers replicated over ``stage`` (off) and split over it (on), every schedule on stage:4,data:2.

    Head FLOPs per step, forward and backward (``6 N V d`` for ``N`` tokens), per stage: off, GPipe and circular
    compute the head after the loop on every stage (GSPMD, replicated over ``stage``), 1F1B and ZB-H1 on the last
    stage only; on, every stage computes its ``V / S`` slice.
    """
    rows, m, stages = [], 4, 4
    for schedule in SCHEDULES:
        for on in (False, True):
            config = _config("stage:4,data:2", "fsdp", schedule, m, batch=2 * m)
            config.model.vocab_size, config.model.pipeline_vocab_parallel = _FLAGS.vocab_size, on
            spec, compiled = _compiled_step(config)
            memory, cfg = compiled.memory_analysis(), spec.cfg
            head = 6 * config.batch_size * config.data.seq_len * cfg.vocab_size * cfg.d_model // 2  # per data replica
            if on:
                per_stage = [head // stages] * stages
            elif schedule in pipeline_schedule.SCHEDULES:  # the last stage's head and loss
                per_stage = [0] * (stages - 1) + [head]
            else:  # after the forward loop, replicated over `stage`
                per_stage = [head] * stages
            table = spec.shardings.params["embed"]["embedding"]
            rows.append({
                "schedule": schedule, "vocab_parallel": on, "vocab_size": cfg.vocab_size,
                "param_bytes_per_device": _bytes_per_device(spec.shardings.params, spec.model_def.abstract_params),
                "table_bytes_per_device": int(np.prod(table.shard_shape((cfg.vocab_size, cfg.d_model)))) * 4,
                "argument_bytes": int(memory.argument_size_in_bytes), "temp_bytes": int(memory.temp_size_in_bytes),
                "head_flops_per_stage": per_stage,
            })  # fmt: skip
            print(f"compiled {schedule} vocab_parallel={on}: temp {rows[-1]['temp_bytes'] / 2**20:.2f} MiB", flush=True)
    return rows


def skip_tables() -> list[dict]:
    """SkipPipe's tick tables at every skip rate the constraints allow (`skip_schedule.paths`, seed 0)."""
    rows = []
    for stages in (4, 8):
        for m in (8, 16):
            for n in range(skip_schedule.max_skips(stages) + 1):
                items, sources = skip_schedule.tick_table(skip_schedule.paths(stages, m, n / stages), stages)
                rows.append({
                    "stages": stages, "microbatches": m, "skip_rate": n / stages, "ticks": int(items.shape[0]),
                    "bubble": skip_schedule.bubble_fraction(items), "throughput": skip_schedule.throughput(items),
                    "group_runs": int((items >= 0).sum()), "hop_distances": list(skip_schedule.offsets(sources)),
                })  # fmt: skip
    return rows


def main(argv) -> None:
    del argv
    cli.require_counts("devices", "seq_len", "vocab_size")
    if unknown := sorted(set(_FLAGS.sections) - set(SECTIONS)):
        cli.usage_exit(f"unknown section(s) {unknown}; use {', '.join(SECTIONS)}")
    jax.config.update("jax_platforms", "cpu")
    cpu_devices.use(_FLAGS.devices)
    start = time.time()
    sections = set(_FLAGS.sections)
    results = {"bubbles": bubbles(), "memory": memory_and_bytes() if "memory" in sections else []}
    if "bubbles" in sections:
        print("\nschedule   S  M  ticks  bubble(table)  formula               1F1B's")
        for row in results["bubbles"]:
            print(
                f"{row['schedule']:9} {row['stages']:2} {row['microbatches']:3} {row['ticks']:5}   {row['bubble']:.3f}          "
                f"{row['formula']:.3f} {row['formula_text']:15} {row['one_f_one_b_formula']:.3f}"
            )
    if results["memory"]:
        print("\nschedule   M  ticks  temp MiB/device  permute execs  permute bytes/step  payloads  one microbatch bytes")
    for row in results["memory"]:
        print(
            f"{row['schedule']:9} {row['microbatches']:3} {row['ticks']:5} {row['temp_bytes'] / 2**20:14.2f} {row['permute_executions']:14d} "
            f"{row['permute_bytes_per_step']:19,d} {row['permute_payloads']!s:>9} {row['microbatch_activation_bytes']:20,d}"
        )
    by = {(r["schedule"], r["microbatches"]): r["temp_bytes"] for r in results["memory"]}
    top = max(int(x) for x in _FLAGS.microbatches)
    for schedule in ("1f1b", "zb_h1"):
        if ("gpipe", top) in by and (schedule, top) in by:
            results[f"{schedule}_over_gpipe_temp_at_max_m"] = by[(schedule, top)] / by[("gpipe", top)]
            print(f"\n{schedule} / gpipe temporaries at M={top}: {results[f'{schedule}_over_gpipe_temp_at_max_m']:.2f}")
    if "vocab" in sections:
        results["vocab"] = vocab_balance()
        print(f"\nvocab {_FLAGS.vocab_size}, stage:4,data:2  params MiB/device  table MiB/device  args MiB  temp MiB  head GFLOP/step per stage")
        for row in results["vocab"]:
            print(
                f"{row['schedule']:9} {'on ' if row['vocab_parallel'] else 'off'} {row['param_bytes_per_device'] / 2**20:16.2f} "
                f"{row['table_bytes_per_device'] / 2**20:16.2f} {row['argument_bytes'] / 2**20:9.2f} {row['temp_bytes'] / 2**20:9.2f}  "
                f"{[round(f / 1e9, 3) for f in row['head_flops_per_stage']]}"
            )
    if "skip" in sections:
        results["skip"] = skip_tables()
        print("\nSkipPipe  S   M  skip rate  ticks  bubble  microbatches/tick  group runs  hop distances")
        for row in results["skip"]:
            print(
                f"{row['stages']:10d} {row['microbatches']:3d} {row['skip_rate']:9.3f} {row['ticks']:6d} {row['bubble']:7.3f} "
                f"{row['throughput']:18.3f} {row['group_runs']:11d}  {row['hop_distances']}"
            )
    if _FLAGS.steps and "exactness" in sections:
        results["exactness"] = exactness()
        worst = max(r["max_rel_loss_diff"] for r in results["exactness"])
        print(f"\n{_FLAGS.steps} steps, every schedule, mesh and optimizer: max relative loss difference to one device {worst:.2e}")
    results["seconds"] = time.time() - start
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
