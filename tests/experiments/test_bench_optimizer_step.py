import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path, *flags):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "experiments.bench_optimizer_step", *flags, f"--json_out={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    return result, (json.loads(out.read_text()) if out.exists() else None)


def test_tiny_tree_end_to_end_with_amortised_refresh_rows(tmp_path):
    optimizers = "--optimizers=adamw,sgd,lion,soap,soap_refresh,shampoo,shampoo_refresh"
    result, data = _bench(tmp_path, optimizers, "--trees=tiny", "--repeats=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert data["mode"] == "update"
    rows = data["trees"]["tiny"]
    assert list(rows) == ["adamw", "sgd", "lion", "soap", "soap_refresh", "shampoo", "shampoo_refresh", "shampoo@10", "shampoo@100", "soap@10", "soap@100"]
    assert rows["adamw"]["vs_adamw"] == 1.0 and rows["sgd"]["ms"] > 0
    # AdamW keeps two fp32 moments per parameter, SGD (momentum) and Lion one.
    assert rows["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=1e-3)
    assert rows["sgd"]["state_bytes_per_param"] == pytest.approx(4.0, abs=1e-3)
    assert rows["lion"]["state_bytes_per_param"] == pytest.approx(4.0, abs=1e-3)
    assert "B/param" in result.stdout
    # Shampoo's blocked statistics and grafting state: well above AdamW's 8 bytes.
    assert rows["shampoo"]["state_bytes_per_param"] == rows["shampoo@10"]["state_bytes_per_param"] > 8
    for name in ("soap", "shampoo"):
        for k in (10, 100):  # a refresh every k steps, amortised
            want = ((k - 1) * rows[name]["ms"] + rows[f"{name}_refresh"]["ms"]) / k
            assert rows[f"{name}@{k}"]["ms"] == pytest.approx(want)
            assert rows[f"{name}@{k}"]["vs_adamw"] == pytest.approx(want / rows["adamw"]["ms"])


def test_whole_training_steps(tmp_path):
    flags = ["--optimizers=adamw,lion", "--trees=tiny", "--train_batch=4x16", "--repeats=1"]
    result, data = _bench(tmp_path, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert data["mode"] == "train step 4x16"
    rows = data["trees"]["tiny"]
    assert list(rows) == ["adamw", "lion"] and all(r["ms"] > 0 for r in rows.values())
    assert rows["adamw"]["vs_adamw"] == 1.0
    # The model's own parameters: Lion keeps one fp32 moment per parameter.
    assert rows["lion"]["state_bytes_per_param"] == pytest.approx(4.0, abs=1e-3)
    assert "whole training step, batch 4x16" in result.stdout


@pytest.mark.parametrize(
    "names, train_step, message",
    [
        (["adamz"], False, "unknown row 'adamz'"),
        (["shampoo@10"], False, "computed from its plain and _refresh rows"),
        (["adamw_refresh"], False, "unknown row 'adamw_refresh'"),
        (["optax_muon"], True, "cannot run as a training step"),
    ],
)
def test_bad_rows_exit_2_naming_the_fix(names, train_step, message, capsys):
    from experiments import bench_optimizer_step

    with pytest.raises(SystemExit) as exit_info:
        bench_optimizer_step.row_names(names, train_step=train_step)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_training_steps_take_any_model_preset_and_updates_the_dense_ones(capsys):
    """Update rows time `param_tree`'s arrays: its own trees, or a dense preset's shapes, exactly the model's."""
    import functools

    import jax

    from experiments import bench_optimizer_step
    from lm import config as config_lib
    from lm import model as model_lib

    bench_optimizer_step.check_trees(["gpt2-124m", "moe-tiny"], train_step=True)
    bench_optimizer_step.check_trees(["tiny", "small", "gpt2-124m", "llama-1b"], train_step=False)
    with pytest.raises(SystemExit) as exit_info:
        bench_optimizer_step.check_trees(["moe-tiny"], train_step=False)
    assert exit_info.value.code == 2 and "any model preset with --train_batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_optimizer_step.check_trees(["gpt2-125m"], train_step=True)

    def shapes(tree):
        return sorted(leaf.shape for leaf in jax.tree.leaves(tree))

    for preset in ("gpt2-124m", "llama-1b"):
        tree = jax.eval_shape(functools.partial(bench_optimizer_step.param_tree, **bench_optimizer_step.tree_dims(preset)))
        assert shapes(tree) == shapes(model_lib.define(config_lib.from_preset(preset)).abstract_params), preset


def test_row_names_expand_all_and_keep_refresh_rows():
    from experiments import bench_optimizer_step
    from optim import registry

    names = bench_optimizer_step.row_names(["all", "soap_refresh", "optax_muon"], train_step=False)
    assert names == [*sorted(registry.OPTIMIZERS), "soap_refresh", "optax_muon"]
