"""bench_optimizer_comm: each row is the bench config on a GSPMD mesh with its rule preset and optimizer."""

from experiments import bench_optimizer_comm
from experiments.configs import bench_comm as bench_config


def test_rows_set_the_mesh_rules_and_optimizer_without_replicas():
    base = bench_config.get_config()
    config = bench_optimizer_comm.row_config("dion_r8", "fsdp:4,tensor:2", base)
    assert (config.mesh, config.rules, config.replicas) == ("fsdp:4,tensor:2", "tp", "")
    assert config.optimizer.name == "dion" and config.optimizer.dion.rank_fraction == 0.125
    assert base.mesh == "data:8" and base.optimizer.name == "adamw"  # the base config is not modified
    muon = bench_optimizer_comm.row_config("muon_replicated", "fsdp:8", base)
    assert (muon.rules, muon.optimizer.muon.ns_sharding) == ("fsdp", "replicated")
