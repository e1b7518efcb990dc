"""The planner for a cluster shape (`experiments.plan` with ``devices_per_host``): a host's share of memory and
the collective bytes of one step, counted from the compiled HLO."""

import pytest

from experiments import plan
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib

# Untied embeddings: a tied table's two gradients (lookup and readout) are all-reduced apart, before they are summed.
SHAPE = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "mlp_dim": 64, "tie_embeddings": False}


@pytest.mark.devices(8)
def test_data_parallel_cluster_all_reduces_every_gradient_once_per_step():
    """2 hosts x 4 devices, pure data parallelism: one step all-reduces the fp32 gradients, ``P`` bytes moved
    and ``2 (n-1)/n P`` sent per device (ring), plus a few scalars (the loss, the gradient norm)."""
    config = default.get_config()
    config.mesh, config.rules, config.batch_size, config.data.seq_len = "data:8", "dp", 8, 16
    config.model.update(SHAPE)
    report = plan.plan(config, 16 * plan.GiB, devices_per_host=4)
    gradients = report["params_bytes"]  # replicated; the vocabulary padded past the preset's count
    assert gradients >= model_lib.param_counts(config_lib.from_preset("tiny", **SHAPE)).total * 4
    collectives = report["collectives"]
    assert gradients <= collectives["payload_bytes_per_step"] <= gradients + 64
    assert collectives["ring_bytes_per_step"] == pytest.approx(2 * 7 / 8 * collectives["payload_bytes_per_step"])
    assert set(collectives["ops"]) == {"all-reduce"}
    assert (report["hosts"], report["devices_per_host"]) == (2, 4)
    assert report["per_host"]["peak_bytes"] == 4 * report["peak_bytes"]
    assert report["per_host"]["ring_bytes_per_step"] == 4 * collectives["ring_bytes_per_step"]
    text = plan.format_report(report)
    assert "per host (2 hosts x 4 devices)" in text and "collectives per step per device" in text
    with pytest.raises(plan.cli.UsageError, match="do not fill hosts"):
        plan._per_host(dict(report), 3)
