import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cli, compare_optimizers, run_spec, trainer
from experiments.configs import compare_quick

REPO = Path(__file__).resolve().parents[2]
STEPS, EVAL_EVERY, BATCH, SEQ = 40, 10, 8, 32

# Synthetic validation curves (evaluations at steps 10..40) per (optimizer, learning rate); a seed
# adds 0.01 * seed. AdamW at 1e-2 is better mid-run but worse at the end; Lion reaches AdamW's final
# loss in half the steps at half the throughput; SGD never reaches it; SGD at lr 10 diverges.
CURVES = {
    ("adamw", 1e-3): [3.0, 2.5, 2.2, 2.0],
    ("adamw", 1e-2): [2.4, 2.2, 2.1, 2.05],
    ("lion", 1e-4): [2.8, 2.0, 1.9, 1.8],
    ("sgd", 0.1): [3.5, 3.0, 2.8, 2.6],
}
THROUGHPUT = {"adamw": 1000.0, "lion": 500.0, "sgd": 2000.0}
BITS_PER_NAT_AND_BYTE = {"adamw": 0.5, "lion": 0.5}  # runs with a byte count report bits per byte; SGD's has none


class FakeTrain:
    """Stands in for `trainer.run`: writes the files a finished run leaves, from `CURVES`."""

    def __init__(self, interrupt: str | None = None):
        self.calls: list[str] = []
        self.interrupt = interrupt

    def __call__(self, config, workdir):
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.calls.append(workdir.name)
        resolved = run_spec.resolve(config, run_spec.build_run(config).cfg)  # what `trainer.run` writes
        (workdir / "config.json").write_text(resolved.to_json_best_effort(indent=2))
        if workdir.name == self.interrupt:
            return {"interrupted": True, "steps": 5, "signal": 15}
        name, lr = config.optimizer.name, config.optimizer.learning_rate
        if (name, lr) not in CURVES:
            raise trainer.NonFiniteError("5 consecutive steps had a non-finite loss")
        vals = [v + 0.01 * config.seed for v in CURVES[name, lr]]
        steps = range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)
        records = [{"step": s, "loss": v, "val_loss": v} for s, v in zip(steps, vals, strict=True)]
        (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        summary = {"final_val_loss": vals[-1], "tokens_per_second": THROUGHPUT[name]}
        if name in BITS_PER_NAT_AND_BYTE:
            summary["final_val_bits_per_byte"] = vals[-1] * BITS_PER_NAT_AND_BYTE[name]
        (workdir / "summary.json").write_text(json.dumps(summary))
        return summary


def _config():
    config = compare_quick.get_config()
    config.steps, config.eval_every, config.batch_size, config.data.seq_len = STEPS, EVAL_EVERY, BATCH, SEQ
    config.compare.optimizers = "adamw,lion,sgd"
    config.compare.grid.adamw.learning_rate = "1e-3,1e-2"
    config.compare.grid.lion.learning_rate = "1e-4"
    config.compare.grid.sgd.learning_rate = "0.1,10"
    config.compare.seeds = "0,1"
    config.compare.update_timing_repeats = 2
    return config


def test_protocol_picks_by_final_loss_adds_seeds_and_measures_speedups(tmp_path, monkeypatch):
    first = FakeTrain(interrupt="lion-lr0.0001-seed1")
    monkeypatch.setattr(trainer, "run", first)
    with pytest.raises(compare_optimizers.Interrupted, match="lion-lr0.0001-seed1 stopped after step 5; rerun"):
        compare_optimizers.compare(_config(), tmp_path, log=lambda line: None)
    grid = ["adamw-lr0.001-seed0", "adamw-lr0.01-seed0", "lion-lr0.0001-seed0", "sgd-lr0.1-seed0", "sgd-lr10-seed0"]
    assert first.calls == [*grid, "adamw-lr0.001-seed1", "lion-lr0.0001-seed1"]

    second = FakeTrain()
    monkeypatch.setattr(trainer, "run", second)
    lines = []
    results = compare_optimizers.compare(_config(), tmp_path, log=lines.append)
    assert second.calls == ["lion-lr0.0001-seed1", "sgd-lr0.1-seed1"]  # finished and diverged runs are skipped
    assert lines[0] == "[1/8] adamw-lr0.001-seed0: finished earlier (final val loss 2.0000), skipped"
    assert "[8/8] sgd-lr0.1-seed1: final val loss 2.6100" in lines[-2]

    assert [row["optimizer"] for row in results["optimizers"]] == ["lion", "adamw", "sgd"]  # ranked by tokens to target
    rows = {row["optimizer"]: row for row in results["optimizers"]}
    assert rows["adamw"]["best_setting"] == {"learning_rate": 1e-3}  # final loss decides, not mid-run
    assert rows["adamw"]["seeds"] == [0, 1]
    assert rows["adamw"]["final_val_loss_mean"] == pytest.approx(2.005)
    assert rows["adamw"]["final_val_loss_std"] == pytest.approx(0.01 / 2**0.5)
    assert rows["adamw"]["final_val_bits_per_byte_mean"] == pytest.approx(2.005 * 0.5)
    assert rows["sgd"]["final_val_bits_per_byte_mean"] is None
    assert rows["adamw"]["speedup_tokens"]["text"] == "1.00x"
    assert rows["lion"]["speedup_tokens"]["value"] == pytest.approx(2.0)
    assert rows["lion"]["speedup_seconds"]["value"] == pytest.approx(1.0)  # twice as fast per token, half the throughput
    assert rows["sgd"]["best_setting"] == {"learning_rate": 0.1}
    assert rows["sgd"]["speedup_tokens"]["text"] == "<1.00x (not reached)"
    assert rows["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)  # two fp32 moments
    assert rows["lion"]["state_bytes_per_param"] == pytest.approx(4.0, abs=0.01)  # one momentum
    assert rows["adamw"]["update_vs_baseline"] == 1.0 and rows["lion"]["update_seconds"] > 0
    # Target: AdamW's mean final loss 2.005. Lion's seeds cross it at steps 10 + 7.95 * (2.8 - 2.005) / 0.8 ... (linear
    # between evaluations): 19.9375 and 20.5 steps of 256 tokens; a 2-seed t-interval is mean +- t_{0.975,1} |a - b| / 2.
    reach = rows["lion"]["tokens_to_target"]
    assert reach["target"] == pytest.approx(2.005)
    assert reach["per_seed"] == pytest.approx([19.9375 * 256, 20.5 * 256])
    assert reach["mean"] == pytest.approx(5176) and reach["high"] - reach["mean"] == pytest.approx(12.706205 * 72)
    assert rows["adamw"]["tokens_to_target"]["per_seed"] == [pytest.approx(39.75 * 256), None]  # seed 1 ends at 2.01
    assert rows["sgd"]["tokens_to_target"]["reached"] == 0
    # Welch with equal spreads and n = 2 each: df = 2, p = 1 - |t| / sqrt(2 + t^2), t = -0.2 / 0.01 * sqrt(2).
    t = -0.2 / 0.01 * 2**0.5
    assert rows["lion"]["welch_vs_baseline"] == pytest.approx({"t": t, "df": 2.0, "p": 1 - abs(t) / (2 + t * t) ** 0.5})
    assert rows["adamw"]["welch_vs_baseline"] is None

    on_disk = json.loads((tmp_path / "results.json").read_text())
    statuses = {run["name"]: run["status"] for run in on_disk["runs"]}
    assert len(statuses) == 8 and statuses["sgd-lr10-seed0"] == "diverged"
    table = (tmp_path / "results.md").read_text()
    assert "| 1 | lion | lr 0.0001 | 1.8050 ± 0.0071 | 0.0012 | 5,176 [4,261, 6,091] | 0.9025 | 2 | 2.00x | 1.00x | 4.00 |" in table
    assert "| 2 | adamw | lr 0.001 (low edge) | 2.0050 ± 0.0071 | - | reached by 1/2 seeds | 1.0025 | 2 | 1.00x |" in table
    assert "| 3 | sgd | lr 0.1 (low edge) | 2.6050 ± 0.0071 | 0.00014 | reached by 0/2 seeds | - | 2 |" in table
    assert "the optimum may lie outside it" in table and rows["lion"]["grid_edges"] == {}  # one value: no edge
    assert "| sgd-lr10-seed0 | diverged |" in table and "| adamw-lr0.001-seed0 * | 2.0000 |" in table
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert results["target_val_loss"] is None and "Steps to validation loss" not in table  # no target, no table

    third = FakeTrain()
    monkeypatch.setattr(trainer, "run", third)
    costs = {r["optimizer"]: {k: r[k] for k in ("state_bytes_per_param", "update_seconds")} for r in results["optimizers"]}
    monkeypatch.setattr(compare_optimizers, "optimizer_costs", lambda configs, repeats: costs)
    again = compare_optimizers.compare(_config(), tmp_path, log=lambda line: None, target_val_loss=2.2)
    assert third.calls == []  # a target is read off the finished runs
    assert [r["speedup_tokens"] for r in again["optimizers"]] == [r["speedup_tokens"] for r in results["optimizers"]]
    # Fewest steps to val loss <= 2.2, first evaluation at or below it: AdamW's seed 0 is at 2.2 at step 30, seed 1
    # (2.21) only at step 40; Lion's seeds at step 20 (2.0, 2.01); SGD never.
    steps = {r["optimizer"]: r["steps_to_target"] for r in again["optimizers"]}
    assert steps["adamw"] == {
        "target": 2.2, "per_seed_steps": [30, 40], "reached": 2, "seeds": 2, "mean_steps": 35, "mean_tokens": 35 * 256, "vs_baseline": 1.0
    }
    assert steps["lion"]["mean_steps"] == 20 and steps["lion"]["vs_baseline"] == pytest.approx(20 / 35)
    assert steps["sgd"]["reached"] == 0 and steps["sgd"]["mean_steps"] is None and steps["sgd"]["vs_baseline"] is None
    assert compare_optimizers.steps_table(again)[2:] == [
        "| optimizer | best setting | steps to 2.2 (mean) | tokens (mean) | steps per seed | steps (x adamw) |",
        "|---|---|---|---|---|---|",
        "| lion | lr 0.0001 | 20.0 | 5,120 | 20, 20 | 0.57 |",
        "| adamw | lr 0.001 | 35.0 | 8,960 | 30, 40 | 1.00 |",
        "| sgd | lr 0.1 | not reached (0/2 seeds) | - | never, never | - |",
    ]
    assert "Steps to validation loss <= 2.2: per seed the first evaluation at or below it (every 10 steps)" in (tmp_path / "results.md").read_text()

    other_family = _config()
    other_family.optimizer.muon.beta = 0.5  # no run here uses Muon: its block does not count
    assert compare_optimizers.compare(other_family, tmp_path, log=lambda line: None)["runs"] == again["runs"]
    assert third.calls == []
    changed = _config()
    changed.steps = 80
    with pytest.raises(cli.UsageError, match=r"adamw-lr0.001-seed0 holds a run with other settings \(steps: 40 -> 80\)"):
        compare_optimizers.compare(changed, tmp_path, log=lambda line: None)


def test_bad_grids_are_usage_errors():
    config = _config()
    config.compare.grid.lion.learning_rate = ""
    with pytest.raises(cli.UsageError, match="compare.grid.lion.learning_rate is empty"):
        compare_optimizers.parse_grid(config)
    config.compare.grid.lion.learning_rate = "1e-4,fast"
    with pytest.raises(cli.UsageError, match="not a comma-separated list"):
        compare_optimizers.parse_grid(config)
    config.compare.grid.lion.learning_rate = "1e-4"
    config.compare.grid.lion.weight_decay = "0.1,1.0"
    assert compare_optimizers.parse_grid(config)["lion"] == [
        {"learning_rate": 1e-4, "weight_decay": 0.1},
        {"learning_rate": 1e-4, "weight_decay": 1.0},
    ]
    config.compare.seeds = "0,0"
    with pytest.raises(cli.UsageError, match="seeds='0,0' must be distinct non-negative integers, comma-separated, e.g. --seeds=0,1,2"):
        compare_optimizers.parse_grid(config)
    config.compare.seeds = "0,1"
    config.compare.baseline = "sgd_typo"
    with pytest.raises(cli.UsageError, match="compare.baseline='sgd_typo' must be one of"):
        compare_optimizers.parse_grid(config)
    config.compare.baseline = "adamw"
    config.compare.update_timing_repeats = 0  # the median of no timings crashed after every run had trained
    with pytest.raises(cli.UsageError, match="compare.update_timing_repeats=0 must be >= 1"):
        compare_optimizers.parse_grid(config)


def _cli(tmp_path, *args):
    # The seeds of a setting compile the same step: a compilation cache lets the second seed's run reuse it.
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env = {**os.environ, "PYTHONPATH": str(REPO), **cache}
    command = [sys.executable, "-m", "experiments.compare_optimizers", f"--workdir={tmp_path}", "--quick", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_quick_cli_end_to_end(tmp_path):
    """Two real training runs of the smallest comparison; the outputs parse."""
    small = [
        "--config.steps=6",
        "--config.eval_every=3",
        "--config.log_every=3",
        "--config.batch_size=4",
        "--config.data.seq_len=32",
        "--config.eval_batches=1",
        "--config.optimizer.warmup_steps=1",
        "--config.compare.optimizers=adamw,sgd",
        "--config.compare.grid.adamw.learning_rate=3e-3",
        "--config.compare.grid.sgd.learning_rate=0.3",
        "--seeds=0,1",
        "--config.compare.update_timing_repeats=2",
        "--target_val_loss=100",  # above any loss: every seed is there at the first evaluation
    ]
    result = _cli(tmp_path, *small)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[1/4] adamw-lr0.003-seed0: training 6 steps" in result.stdout and "[4/4] sgd-lr0.3-seed1" in result.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["optimizer"] for r in results["optimizers"]) == ["adamw", "sgd"]
    assert [len(r["curve"]) for r in results["runs"]] == [2, 2, 2, 2]
    rows = {r["optimizer"]: r for r in results["optimizers"]}
    assert rows["adamw"]["seeds"] == [0, 1] and len(rows["sgd"]["final_val_losses"]) == 2
    assert 0 <= rows["sgd"]["welch_vs_baseline"]["p"] <= 1 and rows["adamw"]["tokens_to_target"]["seeds"] == 2
    assert results["tokens_per_run"] == 6 * 4 * 32
    for row in results["optimizers"]:
        assert row["final_val_loss_mean"] > 0 and row["speedup_tokens"]["text"].endswith(("x", "(not reached)"))
    assert "| sgd | lr 0.3 |" in (tmp_path / "results.md").read_text()
    assert rows["sgd"]["steps_to_target"]["per_seed_steps"] == [3, 3] and rows["sgd"]["steps_to_target"]["vs_baseline"] == 1.0
    assert "| sgd | lr 0.3 | 3.0 | 384 | 3, 3 | 1.00 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "curves.png").is_file()
    assert (tmp_path / "runs" / "sgd-lr0.3-seed0" / "summary.json").is_file()

    unknown = _cli(tmp_path, "--config.compare.optimizers=adamw,adamx")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        f"error: unknown optimizer 'adamx' in compare.optimizers; registered: {', '.join(sorted(compare_optimizers.registry.OPTIMIZERS))}"
    ]
