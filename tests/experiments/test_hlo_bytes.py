"""Collective bytes counted from compiled HLO: loops multiply, conditional branches are set apart."""

import jax
import jax.numpy as jnp
import pytest

from experiments import hlo_bytes
from optim import cross_replica


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
    found = hlo_bytes.collectives(hlo, 4)
    assert {c.kind for c in found} == {"all-reduce", "all-gather"} and all(c.group == 4 for c in found)
    summary = hlo_bytes.summarize(found, sync_every=10, tokens_per_step=8)
    assert summary["payload"]["every_step"] == 4 * 64
    assert summary["payload"]["per_sync"] == 64  # the gathered result
    assert summary["payload"]["per_step"] == pytest.approx(4 * 64 + 64 / 10)
    assert summary["ring"]["every_step"] == pytest.approx(4 * 2 * 3 / 4 * 64)
    assert summary["ring"]["per_sync"] == pytest.approx(3 * 16)
    assert summary["payload"]["per_token"] == pytest.approx((4 * 64 + 6.4) / 8)


@pytest.mark.devices(4)
def test_one_branch_of_a_switch_counts_and_a_sync_period_scope_sets_its_amortisation():
    """A switch runs one branch: the largest counts; collectives under ``sync_period_5`` count once per 5 steps."""
    mesh = jax.make_mesh((4,), ("r",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def pair(v):
        return jax.lax.ppermute(v, "r", [(0, 1), (1, 0), (2, 3), (3, 2)])  # 64 bytes

    def twice(v):
        with cross_replica.sync_period(5):
            return jax.lax.psum(jnp.sin(jax.lax.psum(v, "r")), "r")  # 2 x 64 bytes

    def body(x, index):
        return jax.lax.switch(index[0], [lambda v: v, pair, twice], x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("r"), out_specs=jax.P("r"), check_vma=False))
    found = hlo_bytes.collectives(fn.lower(jnp.ones((4, 16)), jnp.ones((4,), jnp.int32)).compile().as_text(), 4)
    assert [(c.kind, c.period, c.conditional) for c in found] == [("all-reduce", 5, True)] * 2
    summary = hlo_bytes.summarize(found, sync_every=10, tokens_per_step=8)
    assert summary["payload"]["per_sync"] == 128
    assert summary["payload"]["per_step"] == pytest.approx(128 / 5)


@pytest.mark.devices(4)
def test_gather_scatter_and_all_to_all_of_one_buffer_count_the_same_bytes():
    """Each moves one 256-byte buffer per device (f32[4, 16]): payload 256, ring 3/4 of it."""
    mesh = jax.make_mesh((4,), ("r",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def body(piece, full):
        gathered = jax.lax.all_gather(piece, "r", tiled=True)  # f32[1, 16] -> f32[4, 16]
        scattered = jax.lax.psum_scatter(full, "r", tiled=True)  # f32[4, 16] -> f32[1, 16]
        exchanged = jax.lax.all_to_all(full * 2, "r", 0, 0, tiled=True)  # f32[4, 16] -> f32[4, 16]
        return gathered + exchanged + jnp.sum(scattered)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("r"), out_specs=jax.P("r"), check_vma=False))
    found = hlo_bytes.collectives(fn.lower(jnp.ones((4, 16)), jnp.ones((16, 16))).compile().as_text(), 4)
    assert sorted((c.kind, c.payload, c.ring) for c in found) == [
        ("all-gather", 256, 192),
        ("all-to-all", 256, 192),
        ("reduce-scatter", 256, 192),
    ]


def test_async_all_gather_counts_its_result_not_the_input_output_tuple():
    hlo = """ENTRY %main (p: f32[4]) -> f32[16] {
  %p = f32[4]{0} parameter(0)
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %agd = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %ags)
}
"""
    assert hlo_bytes.collectives(hlo, 4) == [hlo_bytes.Collective("all-gather", 64, 4, 1, False)]


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
    assert hlo_bytes.group_size(line, 8) == size
