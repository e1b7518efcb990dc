r"""Compares optimizers fairly: same model, data and token budget, each with its own tuned learning rate.

    python -m experiments.compare_optimizers --workdir=runs/compare_quick --quick
    python -m experiments.compare_optimizers --workdir=runs/compare --seeds=0,1,2 \
        --config.compare.optimizers=adamw,muon,soap --config.steps=4000

The protocol follows "Fantastic Pretraining Optimizers and Where to Find Them" (Wen et al.,
arXiv:2509.02046) and AlgoPerf (Dahl et al., arXiv:2306.07179):

1. every optimizer runs its own grid (``compare.grid.<name>``: learning rate, optionally weight decay
   and warmup) with the first of the seeds (``--seeds`` / ``compare.seeds``, e.g. ``0,1,2``), and its
   best setting is the one with the lowest *final* validation loss;
2. the best setting runs again with the other seeds; the table reports the mean and standard
   deviation of the final validation loss over the seeds and Welch's t-test of it against the
   baseline's (two-sided p-value, `experiments.seed_stats`), the modded-nanogpt optimizer track's
   standard for a claimed improvement;
3. the target is the baseline's (AdamW's) final validation loss, averaged over its seeds. Each seed's
   run reaches it after some tokens (`experiments.speedup.x_to_target`: the first evaluation at or
   below it, linearly interpolated) or never; a row reports the mean over seeds with a 95%
   t-interval when every seed reached it, else how many did (a run that never reaches the target has
   no value to average: its tokens are only known to exceed the budget). Rows are ranked by it:
   first those whose every seed reached the target, by mean tokens; then by how many seeds reached
   it; then by final loss. With the target at the baseline's mean, about half of the baseline's own
   seeds reach it;
4. the speedup over the baseline (AdamW) is tokens the baseline needs to reach its own final loss /
   tokens the optimizer needs to reach it, on the seed-averaged validation curves
   (`experiments.speedup`); the same in wall-clock time, where a run's seconds are its tokens over
   its median training throughput (compilation and evaluation excluded). An optimizer that never
   reaches the target gets no speedup, only a bound ("<1.00x (not reached)");
5. per optimizer, at its best setting: state bytes per parameter (``jax.eval_shape`` of ``init``, no
   allocation) and the time of one jitted ``update`` + ``apply_updates`` on the model's parameters,
   relative to the baseline's (median of round-robin calls);
6. with ``--target_val_loss=T``, the fewest-steps table (the modded-nanogpt optimizer track's measure):
   per seed, the first evaluated step whose validation loss is <= T (no interpolation: its resolution
   is ``eval_every``), and their mean in steps and tokens when every seed reached T, else "not reached"
   by how many; then that mean over the baseline's. The target is a flag, not a rerun: every
   invocation re-reads the finished runs.

Each run is an ordinary ``experiments.train`` run in ``<workdir>/runs/<name>``. Re-running on the same
``--workdir`` skips finished runs (their ``summary.json`` exists) and resumes an interrupted one from
its checkpoint. A run that diverges (``NonFiniteError``) counts as infinite loss and is not retried.
Writes ``results.md`` (the tables), ``results.json`` (every run and curve) and ``curves.png``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from matplotlib.figure import Figure

from experiments import cli, host_memory, metrics_io, run_spec, seed_stats, speedup, trainer
from lm import model as model_lib
from optim import memory, registry

CONFIGS = Path(__file__).parent / "configs"
FULL_CONFIG = str(CONFIGS / "compare.py")
QUICK_CONFIG = str(CONFIGS / "compare_quick.py")
GRID_KEYS = {"learning_rate": "lr", "weight_decay": "wd", "warmup_steps": "warmup"}
DIVERGED = "diverged.json"


class Interrupted(Exception):
    """A run was stopped by a signal; its checkpoint lets a re-run resume it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def parse_grid(config: ml_collections.ConfigDict) -> dict[str, list[dict[str, float]]]:
    """Optimizer name -> the settings of its grid (dicts of optimizer config keys), from ``config.compare``."""
    block = config.compare
    names = [n.strip() for n in block.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in registry.OPTIMIZERS]
    if unknown:
        raise cli.UsageError(
            f"unknown optimizer {', '.join(map(repr, unknown))} in compare.optimizers; registered: {', '.join(sorted(registry.OPTIMIZERS))}"
        )
    if len(set(names)) != len(names) or not names:
        raise cli.UsageError(f"compare.optimizers={block.optimizers!r} must list distinct optimizer names")
    if block.baseline not in names:
        raise cli.UsageError(f"compare.baseline={block.baseline!r} must be one of compare.optimizers ({', '.join(names)})")
    parse_seeds(block.seeds)
    if block.update_timing_repeats < 1:  # timed after every run has trained: refused before the first
        raise cli.UsageError(f"compare.update_timing_repeats={block.update_timing_repeats} must be >= 1")
    grid = {}
    for name in names:
        axes = {}
        for key, text in block.grid[name].items():
            if key not in GRID_KEYS:
                raise cli.UsageError(f"compare.grid.{name}.{key}: the grid keys are {', '.join(GRID_KEYS)}")
            cast = int if key == "warmup_steps" else float
            try:
                values = [cast(v) for v in text.split(",") if v.strip()]
            except ValueError:
                raise cli.UsageError(f"compare.grid.{name}.{key}={text!r} is not a comma-separated list of numbers") from None
            if values:
                axes[key] = values
        if "learning_rate" not in axes:
            raise cli.UsageError(f"compare.grid.{name}.learning_rate is empty; give values, e.g. 1e-3,3e-3")
        grid[name] = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    return grid


def parse_seeds(text: str) -> list[int]:
    """``compare.seeds`` (or ``--seeds``), e.g. ``"0,1,2"``: distinct non-negative integers, the first runs the grid."""
    try:
        seeds = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise cli.UsageError(f"seeds={text!r} must be distinct non-negative integers, comma-separated, e.g. --seeds=0,1,2")
    return seeds


def run_name(optimizer: str, setting: dict[str, float], seed: int) -> str:
    """The run's folder name, e.g. ``adamw-lr0.003-seed0``."""
    return "-".join([optimizer, *(f"{GRID_KEYS[k]}{v:g}" for k, v in setting.items()), f"seed{seed}"])


def run_config(config: ml_collections.ConfigDict, optimizer: str, setting: dict[str, float], seed: int) -> ml_collections.ConfigDict:
    """The training config of one run: ``config`` with the optimizer, its setting and the seed."""
    out = copy.deepcopy(config)
    with out.unlocked():
        del out["compare"]
    out.optimizer.name = optimizer
    for key, value in setting.items():
        out.optimizer[key] = value
    out.seed = seed
    return out


def _record(config: ml_collections.ConfigDict, rundir: Path, optimizer: str, setting: dict, seed: int) -> dict:
    """What the comparison keeps of a finished or diverged run."""
    tokens_per_step = config.batch_size * config.data.seq_len
    metrics = metrics_io.read_metrics(rundir / "metrics.jsonl") if (rundir / "metrics.jsonl").exists() else []
    diverged = (rundir / DIVERGED).exists()
    summary = {} if diverged else json.loads((rundir / "summary.json").read_text())
    tps = summary.get("tokens_per_second")
    curve = [
        {
            "step": r["step"],
            "tokens": r["step"] * tokens_per_step,
            "seconds": r["step"] * tokens_per_step / tps if tps else None,
            "val_loss": r["val_loss"],
            "val_bits_per_byte": r.get("val_bits_per_byte"),
        }
        for r in metrics
        if "val_loss" in r
    ]
    return {
        "name": rundir.name,
        "optimizer": optimizer,
        "setting": setting,
        "seed": seed,
        "status": "diverged" if diverged else "done",
        "final_val_loss": summary.get("final_val_loss"),
        "final_val_bits_per_byte": summary.get("final_val_bits_per_byte"),
        "tokens_per_second": tps,
        "curve": curve,
        "workdir": str(rundir),
    }


def _final(record: dict) -> float:
    return record["final_val_loss"] if record["status"] == "done" and math.isfinite(record["final_val_loss"]) else math.inf


class Runner:
    """Runs (or skips, when already finished) the comparison's runs, one line of progress each."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: Path, total: int, log=print):
        self.config, self.workdir, self.total, self.log = config, workdir, total, log
        self.done = 0

    def __call__(self, optimizer: str, setting: dict[str, float], seed: int) -> dict:
        config = run_config(self.config, optimizer, setting, seed)
        rundir = self.workdir / "runs" / run_name(optimizer, setting, seed)
        self.done += 1
        head = f"[{self.done}/{self.total}] {rundir.name}"
        _check_same_config(config, rundir)
        if (rundir / "summary.json").exists() or (rundir / DIVERGED).exists():
            record = _record(config, rundir, optimizer, setting, seed)
            self.log(f"{head}: finished earlier ({_describe(record)}), skipped")
            return record
        self.log(f"{head}: training {config.steps} steps in {rundir}")
        start = time.perf_counter()
        try:
            summary = trainer.run(config, rundir)
        except trainer.NonFiniteError as e:
            (rundir / DIVERGED).write_text(json.dumps({"error": str(e)}))
            summary = {}
        if summary.get("interrupted"):
            message = f"{rundir.name} stopped after step {summary['steps']}; rerun the same command to resume it"
            raise Interrupted(message, summary["signal"])
        record = _record(config, rundir, optimizer, setting, seed)
        self.log(f"{head}: {_describe(record)} in {time.perf_counter() - start:.0f} s")
        return record


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _check_same_config(config: ml_collections.ConfigDict, rundir: Path) -> None:
    """A run folder from an earlier invocation must hold the run this config asks for.

    Its ``config.json`` is the resolved config (`run_spec.resolve`), so this config is resolved before
    they are compared. The blocks of other optimizer families (``optimizer.<other>.*``) do not take
    part in the run and are not compared, nor keys an older version of the code wrote unresolved (null).
    """
    path = rundir / "config.json"
    if not path.exists():
        return
    resolved = run_spec.resolve(config, run_spec.build_run(config).cfg)
    old, new = _flatten(json.loads(path.read_text())), _flatten(json.loads(resolved.to_json_best_effort()))

    def used(key: str) -> bool:
        parts = key.split(".")
        family = parts[0] == "optimizer" and len(parts) > 2 and parts[1] not in run_spec.used_optimizers(config.optimizer)
        return not family and old.get(key) is not None

    differ = sorted(k for k in old.keys() | new.keys() if used(k) and old.get(k) != new.get(k))
    if differ:
        raise cli.UsageError(
            f"{rundir} holds a run with other settings ({', '.join(f'{k}: {old.get(k)} -> {new.get(k)}' for k in differ[:3])}); "
            "use a fresh --workdir, or the settings it was started with"
        )


def _describe(record: dict) -> str:
    return "diverged" if record["status"] == "diverged" else f"final val loss {record['final_val_loss']:.4f}"


def _random_like(abstract: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(0.02 * rng.standard_normal(p.shape), p.dtype), abstract)


def optimizer_costs(configs: dict[str, ml_collections.ConfigDict], repeats: int) -> dict[str, dict[str, float]]:
    """State bytes per parameter and median seconds of one jitted update, per optimizer config.

    Each optimizer is built as training builds it (`run_spec.build_run`) on the model's parameters
    (random values, one device); extra update arguments the model supplies in training (e.g.
    ``attn_max_logits``) are passed as zeros of their shapes. Calls are timed round-robin, so load
    from other processes affects every optimizer alike.
    """
    calls, costs, arrays = {}, {}, {}
    for name, config in configs.items():
        spec = run_spec.build_run(config)
        abstract = spec.model_def.abstract_params
        n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(abstract))
        costs[name] = {"state_bytes_per_param": memory.state_bytes(jax.eval_shape(spec.tx.init, abstract)) / n_params}
        if spec.cfg not in arrays:
            arrays[spec.cfg] = tuple(_random_like(abstract, seed) for seed in (0, 1))
        params, grads = arrays[spec.cfg]
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        aux = jax.eval_shape(lambda p, t, d=spec.model_def: model_lib.apply(d, p, t, return_aux=True)[1], abstract, tokens)
        extra = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux)
        tx = optax.with_extra_args_support(spec.tx)

        @jax.jit
        def step(params, grads, state, tx=tx, extra=extra):
            updates, state = tx.update(grads, state, params, **extra)
            return optax.apply_updates(params, updates), state

        calls[name] = functools.partial(step, params, grads, jax.jit(tx.init)(params))
        jax.block_until_ready(calls[name]())  # compile
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        costs[name]["update_seconds"] = statistics.median(t)
    return costs


def compare(config: ml_collections.ConfigDict, workdir: str | Path, *, log=print, target_val_loss: float | None = None) -> dict:
    """Runs the comparison described by ``config`` into ``workdir``; returns (and writes) the results.
    ``target_val_loss`` adds the steps each optimizer needs to reach it (protocol item 6)."""
    workdir = Path(workdir)
    grid = parse_grid(config)
    for name, settings in grid.items():  # bad settings fail here, before any training
        run_spec.build_run(run_config(config, name, settings[0], 0))
    first, *more = parse_seeds(config.compare.seeds)
    runner = Runner(config, workdir, sum(map(len, grid.values())) + len(more) * len(grid), log)
    runs = {name: [runner(name, setting, first) for setting in settings] for name, settings in grid.items()}
    best = {name: min(records, key=_final) for name, records in runs.items()}
    for name, record in best.items():
        if math.isfinite(_final(record)):
            runs[name] += [runner(name, record["setting"], seed) for seed in more]
        else:
            runner.done += len(more)
            log(f"{name}: every setting diverged; no seeds to add")
    log("timing one update per optimizer")
    costs = optimizer_costs(
        {name: run_config(config, name, record["setting"], first) for name, record in best.items()}, config.compare.update_timing_repeats
    )
    results = summarize(config, runs, best, costs, target_val_loss)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    (workdir / "results.md").write_text(markdown(results))
    plot_curves(results, workdir / "curves.png")
    return results


def summarize(
    config: ml_collections.ConfigDict, runs: dict[str, list[dict]], best: dict[str, dict], costs: dict, target_val_loss: float | None = None
) -> dict:
    """Per-optimizer rows (best setting, seeds' mean and spread, speedups, steps to ``target_val_loss``,
    costs) and every run."""
    baseline = config.compare.baseline
    rows = []
    for name, records in runs.items():
        seeds = [r for r in records if r["setting"] == best[name]["setting"] and r["status"] == "done"]
        finals = [r["final_val_loss"] for r in seeds]
        bits_per_byte = [r["final_val_bits_per_byte"] for r in seeds if r.get("final_val_bits_per_byte") is not None]
        row = {
            "optimizer": name,
            "best_setting": best[name]["setting"],
            "grid_edges": grid_edges(best[name]["setting"], [r["setting"] for r in records]),
            "seeds": [r["seed"] for r in seeds],
            "final_val_loss_mean": statistics.fmean(finals) if finals else None,
            "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0 if finals else None,
            # Bits per byte compare across tokenizers (None where the data has no byte count, e.g. bare shards).
            "final_val_bits_per_byte_mean": statistics.fmean(bits_per_byte) if bits_per_byte else None,
            "tokens_curve": speedup.mean_curve([[(p["tokens"], p["val_loss"]) for p in r["curve"]] for r in seeds]) if seeds else [],
            "seconds_curve": speedup.mean_curve([[(p["seconds"], p["val_loss"]) for p in r["curve"]] for r in seeds]) if seeds else [],
            "final_val_losses": finals,
            "seed_curves": [[(p["tokens"], p["val_loss"]) for p in r["curve"]] for r in seeds],
            "steps_to_target": _steps_to_target([r["curve"] for r in seeds], target_val_loss),
            **costs[name],
        }
        rows.append(row)
    base = next(r for r in rows if r["optimizer"] == baseline)
    base_finals = base["final_val_losses"]
    target = statistics.fmean(base_finals) if base_finals else None
    for row in rows:
        row["tokens_to_target"] = _tokens_to_target(row.pop("seed_curves"), target)
        test = None if row is base else seed_stats.welch(row["final_val_losses"], base_finals)
        row["welch_vs_baseline"] = None if test is None else dataclasses.asdict(test)
        row["update_vs_baseline"] = row["update_seconds"] / base["update_seconds"]
        if row["steps_to_target"] is not None:
            mine, theirs = row["steps_to_target"]["mean_steps"], (base["steps_to_target"] or {}).get("mean_steps")
            row["steps_to_target"]["vs_baseline"] = mine / theirs if mine is not None and theirs else None
        for axis in ("tokens", "seconds"):
            if base[f"{axis}_curve"] and row[f"{axis}_curve"]:
                s = speedup.speedup(base[f"{axis}_curve"], row[f"{axis}_curve"])
                row[f"speedup_{axis}"] = {"value": s.value, "upper_bound": s.upper_bound, "text": str(s), "target": s.target}
            else:
                row[f"speedup_{axis}"] = None
    rows.sort(key=_rank_key)
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return {
        "baseline": baseline,
        "model": config.model.preset,
        "steps": config.steps,
        "eval_every": config.eval_every,
        "tokens_per_run": config.steps * config.batch_size * config.data.seq_len,
        "target_val_loss": target_val_loss,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "optimizers": rows,
        "runs": [r for records in runs.values() for r in records],
        "config": json.loads(config.to_json_best_effort()),
    }


def grid_edges(setting: dict[str, float], settings: list[dict[str, float]]) -> dict[str, str]:
    """The grid keys at which ``setting`` is the smallest or largest value tried (of two or more): there the
    best value may lie outside the grid. ``{"learning_rate": "low"}``: widen the grid below."""
    out = {}
    for key, value in setting.items():
        tried = sorted({s[key] for s in settings if key in s})
        if len(tried) > 1 and value in (tried[0], tried[-1]):
            out[key] = "low" if value == tried[0] else "high"
    return out


def _tokens_to_target(curves: list[list[tuple[float, float]]], target: float | None) -> dict | None:
    """Per seed, the tokens at which its validation curve reaches ``target`` (None: never); their mean
    and 95% t-interval when every seed reached it."""
    if target is None or not curves:
        return None
    per_seed = [speedup.x_to_target(curve, target) for curve in curves]
    reached = [x for x in per_seed if x is not None]
    out = {"target": target, "per_seed": per_seed, "reached": len(reached), "seeds": len(per_seed)}
    if len(reached) == len(per_seed):
        out |= dataclasses.asdict(seed_stats.t_interval(reached))
    return out


def _steps_to_target(curves: list[list[dict]], target: float | None) -> dict | None:
    """Per seed, the first evaluated step (and its tokens) whose validation loss is <= ``target`` (None:
    never); their means when every seed reached it, else ``mean_steps`` None."""
    if target is None or not curves:
        return None
    firsts = [next((p for p in curve if p["val_loss"] <= target), None) for curve in curves]
    reached = [p for p in firsts if p is not None]
    everyone = len(reached) == len(firsts)
    return {
        "target": target,
        "per_seed_steps": [None if p is None else p["step"] for p in firsts],
        "reached": len(reached),
        "seeds": len(firsts),
        "mean_steps": statistics.fmean(p["step"] for p in reached) if everyone else None,
        "mean_tokens": statistics.fmean(p["tokens"] for p in reached) if everyone else None,
    }


def _fewest_steps_key(row: dict) -> tuple:
    """Every seed at the target first, by fewest mean steps; then most seeds at it."""
    reach = row["steps_to_target"]
    mean = reach["mean_steps"] if reach["mean_steps"] is not None else math.inf
    return (reach["mean_steps"] is None, -reach["reached"], mean)


def steps_table(results: dict) -> list[str]:
    """The fewest-steps table (markdown lines): steps and tokens to ``results["target_val_loss"]``."""
    base, target = results["baseline"], results["target_val_loss"]
    lines = [
        (
            f"Steps to validation loss <= {target:g}: per seed the first evaluation at or below it (every "
            f"{results['eval_every']} steps), the mean over seeds when every seed reached it."
        ),
        "",
        f"| optimizer | best setting | steps to {target:g} (mean) | tokens (mean) | steps per seed | steps (x {base}) |",
        "|---|---|---|---|---|---|",
    ]
    for row in sorted((r for r in results["optimizers"] if r["steps_to_target"]), key=_fewest_steps_key):
        reach = row["steps_to_target"]
        per_seed = ", ".join("never" if s is None else str(s) for s in reach["per_seed_steps"])
        if reach["mean_steps"] is None:
            steps, tokens = f"not reached ({reach['reached']}/{reach['seeds']} seeds)", "-"
        else:
            steps, tokens = f"{reach['mean_steps']:,.1f}", f"{reach['mean_tokens']:,.0f}"
        ratio = "-" if reach["vs_baseline"] is None else f"{reach['vs_baseline']:.2f}"
        lines.append(f"| {row['optimizer']} | {_setting_text(row['best_setting'])} | {steps} | {tokens} | {per_seed} | {ratio} |")
    return lines


def _rank_key(row: dict) -> tuple:
    """Every seed at the target first (fewest mean tokens first), then most seeds at it, then final loss."""
    reach = row["tokens_to_target"]
    loss = row["final_val_loss_mean"] if row["final_val_loss_mean"] is not None else math.inf
    if reach is None:
        return (1, 0, math.inf, loss)
    everyone = reach["reached"] == reach["seeds"]
    return (0 if everyone else 1, -reach["reached"], reach["mean"] if everyone else math.inf, loss)


def _tokens_text(reach: dict | None) -> str:
    if reach is None:
        return "-"
    if reach["reached"] < reach["seeds"]:
        return f"reached by {reach['reached']}/{reach['seeds']} seeds"
    if reach["low"] is None:
        return f"{reach['mean']:,.0f}"
    return f"{reach['mean']:,.0f} [{reach['low']:,.0f}, {reach['high']:,.0f}]"


def _setting_text(setting: dict[str, float], edges: dict[str, str] | None = None) -> str:
    """``lr 0.003, wd 0.1``; a value on the grid's edge marked ``(low edge)`` / ``(high edge)``."""
    edges = edges or {}
    return ", ".join(f"{GRID_KEYS[k]} {v:g}" + (f" ({edges[k]} edge)" if k in edges else "") for k, v in setting.items())


def markdown(results: dict) -> str:
    """The results table, then every grid run's final loss (seed 0; the best setting marked *)."""
    base = results["baseline"]
    header = (
        f"| rank | optimizer | best setting | final val loss (mean ± std) | p (Welch, vs {base}) | tokens to {base}'s final loss "
        f"(mean [95% CI]) | val bits / byte | seeds | speedup (tokens) | speedup (time) | state bytes / param | update time (x {base}) |"
    )
    lines = [
        (
            f"`{results['model']}`, {results['steps']} steps, {results['tokens_per_run']:,} tokens per run; the target is {base}'s "
            "final validation loss (mean over its seeds); speedups are read off the seed-averaged curves."
        ),
        "",
        header,
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["optimizers"]:
        if row["final_val_loss_mean"] is None:
            loss = "diverged"
        else:
            loss = f"{row['final_val_loss_mean']:.4f}" + (f" ± {row['final_val_loss_std']:.4f}" if len(row["seeds"]) > 1 else "")
        tokens = row["speedup_tokens"]["text"] if row["speedup_tokens"] else "-"
        seconds = row["speedup_seconds"]["text"] if row["speedup_seconds"] else "-"
        bits = row.get("final_val_bits_per_byte_mean")
        bits = "-" if bits is None else f"{bits:.4f}"
        welch = row["welch_vs_baseline"]
        p = "-" if welch is None else f"{welch['p']:.2g}"
        lines.append(
            f"| {row['rank']} | {row['optimizer']} | {_setting_text(row['best_setting'], row.get('grid_edges'))} | {loss} | {p} | {_tokens_text(row['tokens_to_target'])} "
            f"| {bits} | {len(row['seeds'])} | {tokens} | {seconds} "
            f"| {row['state_bytes_per_param']:.2f} | {row['update_vs_baseline']:.2f} ({1e3 * row['update_seconds']:.1f} ms) |"
        )
    if any(row.get("grid_edges") for row in results["optimizers"]):
        lines += [
            "",
            "A best value marked (low edge) / (high edge) is the smallest / largest of its grid: the optimum may lie "
            "outside it, so that optimizer may be under-tuned; widen compare.grid.<optimizer> past it and rerun.",
        ]
    if results.get("target_val_loss") is not None:
        lines += ["", *steps_table(results)]
    first = results["runs"][0]["seed"] if results["runs"] else 0
    lines += ["", f"| run (seed {first}) | final val loss |", "|---|---|"]
    best = {row["optimizer"]: row["best_setting"] for row in results["optimizers"]}
    for run in results["runs"]:
        if run["seed"] == first:
            mark = " *" if run["setting"] == best[run["optimizer"]] else ""
            lines.append(f"| {run['name']}{mark} | {_describe(run).removeprefix('final val loss ')} |")
    return "\n".join(lines) + "\n"


def plot_curves(results: dict, path: str | Path) -> None:
    """Seed-averaged validation loss of each optimizer's best setting vs tokens and vs seconds."""
    fig = Figure(figsize=(11, 4), dpi=120)
    axes = fig.subplots(1, 2)
    for ax, axis, label in zip(axes, ("tokens", "seconds"), ("tokens", "seconds (tokens / median throughput)")):
        for row in results["optimizers"]:
            curve = row[f"{axis}_curve"]
            if curve:
                ax.plot(*zip(*curve), "o-", markersize=3, label=f"{row['optimizer']} ({_setting_text(row['best_setting'])})")
        base = next(r for r in results["optimizers"] if r["optimizer"] == results["baseline"])
        if base["tokens_curve"]:
            ax.axhline(base["tokens_curve"][-1][1], color="gray", linestyle=":", linewidth=1, label=f"target ({results['baseline']} final)")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats / token)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{results['model']}, {results['steps']} steps, best setting per optimizer, mean over seeds")
    fig.tight_layout()
    fig.savefig(path)


def define_flags(argv: list[str] | None = None) -> flags.FlagHolder:
    """Flags; ``--quick`` in ``argv`` (default: ``sys.argv``) makes `compare_quick.py` the default config
    (``--config.*`` still apply)."""
    argv = sys.argv if argv is None else argv
    cli.define_output_folder_flag("workdir", None, "Output folder; re-running on it skips finished runs. Default: a fresh folder under ./runs/.")
    flags.DEFINE_string("seeds", None, "Seeds, e.g. 0,1,2 (the first runs the grid); default: the config's compare.seeds.")
    flags.DEFINE_float("target_val_loss", None, "Adds the fewest-steps table: steps each optimizer needs to reach this validation loss.")
    flags.DEFINE_bool("quick", False, f"The reduced comparison of {QUICK_CONFIG} (12 runs of 80 steps: about 7 minutes on 2 CPU cores).")
    cli.define_verbose_flag()
    cli.define_cpu_devices_flag()
    flags.declare_key_flag("cpu_devices")
    default = QUICK_CONFIG if any(a in ("--quick", "--quick=true", "--quick=True") for a in argv[1:]) else FULL_CONFIG
    return cli.define_config_flag(default)


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv  # checked by cli.parse_flags
    host_memory.keep_freed_memory()  # before JAX starts its backend
    cli.split_cpu_devices()
    cli.quiet_logging(flags.FLAGS.verbose)
    if flags.FLAGS.quick and flags.FLAGS["config"].present:
        cli.usage_exit("--quick selects the config; give either --quick or --config=FILE")
    config = config_flag.value
    if flags.FLAGS.seeds is not None:
        config.compare.seeds = flags.FLAGS.seeds
    workdir = flags.FLAGS.workdir or cli.fresh_workdir(f"compare-{config.model.preset}")
    try:
        results = compare(config, workdir, log=functools.partial(print, flush=True), target_val_loss=flags.FLAGS.target_val_loss)
    except cli.UsageError as e:
        if flags.FLAGS.verbose:
            raise
        cli.usage_exit(str(e))
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    print()
    print(markdown(results))
    print(f"wrote {workdir}/results.md, results.json, curves.png")


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=cli.parse_flags)
