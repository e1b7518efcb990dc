"""Collective bytes counted from compiled HLO: loops multiply, conditional branches are set apart."""

import jax
import jax.numpy as jnp
import pytest

from experiments import bench_comm


@pytest.mark.devices(4)
def test_counts_collectives_in_loops_and_branches_of_a_compiled_program():
    mesh = jax.make_mesh((4,), ("r",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def body(x, pred):
        x = jax.lax.psum(x[0], "r")  # f32[16]: 64 bytes, every step

        def loop(c, _):
            return jax.lax.psum(jnp.sin(c), "r"), None

        x, _ = jax.lax.scan(loop, x, None, length=3)  # 3 more all-reduces of 64 bytes
        piece = jax.lax.cond(pred[0], lambda v: jax.lax.all_gather(v[:4], "r", tiled=True), lambda v: v, x)
        return piece[None]  # the branch all-gathers 4 floats from each device

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("r"), out_specs=jax.P("r"), check_vma=False))
    hlo = fn.lower(jnp.ones((4, 16)), jnp.ones((4,), bool)).compile().as_text()
    found = bench_comm.collectives(hlo, 4)
    assert {c.kind for c in found} == {"all-reduce", "all-gather"} and all(c.group == 4 for c in found)
    summary = bench_comm.summarize(found, sync_every=10, tokens_per_step=8)
    assert summary["payload"]["every_step"] == 4 * 64
    assert summary["payload"]["per_sync"] == 16
    assert summary["payload"]["per_step"] == pytest.approx(4 * 64 + 16 / 10)
    assert summary["ring"]["every_step"] == pytest.approx(4 * 2 * 3 / 4 * 64)
    assert summary["ring"]["per_sync"] == pytest.approx(3 * 16)
    assert summary["payload"]["per_token"] == pytest.approx((4 * 64 + 1.6) / 8)


@pytest.mark.parametrize(
    "line, size",
    [
        ("all-reduce(%a), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, to_apply=%add", 4),
        ("all-reduce(%a), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}, to_apply=%add", 8),
        ("all-gather(%a), replica_groups=[2,4]<=[8], dimensions={0}", 4),
        ("all-to-all(%a), replica_groups={{0,1},{2,3}}", 2),
    ],
)
def test_replica_group_formats(line, size):
    assert bench_comm._group_size(line, 8) == size
