import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cli, plan
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib

REPO = Path(__file__).resolve().parents[2]


def _config(mesh, **model):
    config = default.get_config()
    config.mesh, config.batch_size, config.data.seq_len = mesh, 8, 64
    for key, value in model.items():
        config.model[key] = value
    return config


@pytest.mark.devices(8)
def test_fsdp_plan_has_an_eighth_of_the_state_per_device():
    report = plan.plan(_config("fsdp:8"), 16 * plan.GiB)
    total_param_bytes = model_lib.param_counts(config_lib.from_preset("tiny")).total * 4
    assert report["params_bytes"] * 8 == total_param_bytes
    assert report["gradients_bytes"] == report["params_bytes"]
    assert report["optimizer_state_bytes"] >= 2 * report["params_bytes"]  # AdamW: two moments (+ a counter)
    assert report["fits"] and report["peak_bytes"] > report["params_bytes"] + report["optimizer_state_bytes"]
    replicated = plan.plan(_config("data:8"), 16 * plan.GiB, compile_step=False)  # parameter bytes: from the shardings
    assert replicated["params_bytes"] == total_param_bytes


@pytest.mark.devices(8)
def test_remat_lowers_the_activation_estimate():
    plain = plan.plan(_config("fsdp:8", n_layers=8), 16 * plan.GiB)
    remat = plan.plan(_config("fsdp:8", n_layers=8, remat="full"), 16 * plan.GiB)
    assert remat["activations_estimate_bytes"] < plain["activations_estimate_bytes"]


def test_cli_says_when_it_does_not_fit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "experiments.plan", "--config.mesh=fsdp:4", "--hbm_gb=0.001", f"--json_out={tmp_path / 'p.json'}"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "DOES NOT FIT" in result.stdout and "{'fsdp': 4}" in result.stdout
    assert (tmp_path / "p.json").is_file()


@pytest.mark.parametrize(
    "machine, message",
    [
        ((0.0, 8, None, None), "--hbm_gb=0 must be > 0"),  # was planned against 0 GiB: "DOES NOT FIT"
        ((16.0, 0, None, None), "--num_devices=0 must be >= 1"),  # was jax's backend error
        ((16.0, 8, 0, 8), "--hosts=0 must be >= 1"),  # was planned as one host
        ((16.0, 8, 2, None), "--hosts and --devices_per_host go together"),
    ],
)
def test_a_machine_no_plan_can_describe_is_named(machine, message):
    with pytest.raises(cli.UsageError, match=message):
        plan.check_machine_flags(*machine)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "preset, total, active",
    [
        ("mixtral-8x7b", 46.7e9, 12.9e9),  # arXiv:2401.04088
        ("deepseek-v2-lite", 15.7e9, 2.4e9),  # arXiv:2405.04434, appendix B; active without the embedding lookup
    ],
)
def test_large_moe_presets_plan_on_an_expert_fsdp_mesh_at_their_published_sizes(preset, total, active):
    """State only (the step is not compiled): every parameter split 8 ways, routed experts over expert (stack) x fsdp
    (embed), the rest over fsdp x expert (embed, or MLA's latent rank in its up-projections)."""
    config = _config("expert:2,fsdp:4")
    config.model.preset = preset
    report = plan.plan(config, 80 * plan.GiB, compile_step=False)
    cfg = config_lib.from_preset(preset)
    lookup = 0 if cfg.tie_embeddings or preset.startswith("mixtral") else cfg.vocab_size * cfg.d_model
    assert report["num_params"] == pytest.approx(total, rel=0.01)
    assert report["num_active_params"] - lookup == pytest.approx(active, rel=0.03)
    assert report["params_bytes"] == pytest.approx(4 * report["num_params"] / 8, rel=1e-3)
    assert 0 <= report["optimizer_state_bytes"] - 2 * report["params_bytes"] < 1024  # AdamW's two moments and counters
    assert report["state_only"] and report["peak_bytes"] == 2 * report["params_bytes"] + report["optimizer_state_bytes"]
