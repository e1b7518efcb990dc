"""experiments.plan with a ``context`` axis: each device's share of the sequence and the K/V in flight."""

import pytest

from experiments import plan
from experiments.configs import default
from lm import config as config_lib
from lm.parallel import context_attention


def _config(mesh: str, mode: str):
    config = default.get_config()
    config.mesh, config.batch_size, config.data.seq_len, config.model.context_parallel = mesh, 4, 256, mode
    return config


@pytest.mark.devices(8)
@pytest.mark.parametrize("mode, share", [("all_gather", 1.0), ("ring", 0.5)])  # ring: two blocks of a quarter
def test_plan_reports_the_context_split(mode, share):
    report = plan.plan(_config("context:4,data:2", mode), 16 * plan.GiB, compile_step=False)
    cfg = config_lib.from_preset("tiny")
    kv = 2 * 256 * cfg.n_kv_heads * 2 * cfg.head_dim * 4  # two rows per data shard, whole-sequence K and V, float32
    assert report["context"] == {
        "mode": mode, "shards": 4, "tokens_per_device": 2 * 256 // 4, "kv_in_flight_bytes_per_layer": int(kv * share),
    }
    assert "128 tokens per device" in plan.format_report(report)
    assert context_attention.in_flight_bytes("ulysses", cfg, 2, 256, 4) == 2 * 256 * cfg.n_heads * 2 * cfg.head_dim * 4 // 4 + kv // 4


@pytest.mark.devices(8)
def test_plan_without_a_context_axis_has_no_context_part():
    config = _config("fsdp:4,data:2", "ring")
    config.batch_size = 8
    assert plan.plan(config, 16 * plan.GiB, compile_step=False)["context"] is None
