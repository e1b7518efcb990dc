import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib


@pytest.mark.devices(8)
def test_mesh_spec_with_fill_axis():
    mesh = mesh_lib.make_mesh("data:2,fsdp:-1")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.devices(8)
def test_empty_spec_is_data_parallel_over_all_devices():
    assert dict(mesh_lib.make_mesh("").shape) == {"data": 8}


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "spec, message",
    [
        ("data:3", "divisors of 8: \\[1, 2, 4, 8\\]"),
        ("data:3,fsdp:-1", "cannot fill 8 devices"),
        ("data", "name:size"),
        ("data:x", "integer"),
        ("data:-1,fsdp:-1", "more than one -1"),
        ("data:2,data:4", "twice"),
        ("dcn_tensor:2,data:4", "no in-slice axis"),
    ],
)
def test_impossible_meshes_say_what_fits(spec, message):
    with pytest.raises(ValueError, match=message):
        mesh_lib.make_mesh(spec)


@pytest.mark.devices(2)  # the mesh asks for 2; it is built over one CPU device to be refused
def test_a_mesh_larger_than_the_cpu_names_the_split_that_runs_it():
    with pytest.raises(ValueError, match=r"has 2 devices but 1 are present.*--cpu_devices=2, or sharding.cpu_devices.use\(2\)"):
        mesh_lib.make_mesh("data:2", jax.devices("cpu")[:1])


def test_rules_drop_absent_mesh_axes():
    rules = rules_lib.make_rules("tp")
    axes = ("data", "fsdp", "tensor")
    assert rules_lib.logical_to_mesh_spec(("batch", "seq", "embed"), rules.activations, axes) == jax.P(("data", "fsdp"), None, None)
    assert rules_lib.logical_to_mesh_spec(("embed", "mlp"), rules.params, axes) == jax.P("fsdp", "tensor")
    assert rules_lib.logical_to_mesh_spec(("embed", "mlp"), rules.params, ("data",)) == jax.P(None, None)


def test_sequence_parallel_shards_activations_along_seq():
    rules = rules_lib.make_rules("sp")
    assert rules_lib.logical_to_mesh_spec(("batch", "seq", "embed"), rules.activations, ("data", "seq")) == jax.P("data", "seq", None)


def test_two_dimensions_on_one_mesh_axis_is_an_error():
    rules = rules_lib.make_rules("fsdp", {"params.mlp": "fsdp"})
    with pytest.raises(ValueError, match="same mesh axis 'fsdp'"):
        rules_lib.logical_to_mesh_spec(("embed", "mlp"), rules.params, ("fsdp",))


@pytest.mark.parametrize("preset", ["fsdp", "tp"])
def test_expert_axis_splits_embed_where_the_routed_experts_leave_it_free(preset):
    params = rules_lib.make_rules(preset).params
    sizes = {"fsdp": 2, "expert": 4}
    spec = lambda logical, shape=None: rules_lib.logical_to_mesh_spec(logical, params, sizes, shape=shape, axis_sizes=sizes)  # noqa: E731
    assert spec(("embed",)) == jax.P(("fsdp", "expert"))  # a norm scale: ZeRO-3 over both data-parallel axes
    assert spec(("experts", "embed", "mlp"))[:2] == ("expert", "fsdp")  # the stack's experts keep expert
    assert spec(("embed", "experts")) == jax.P("fsdp", "expert")  # the router, whichever dimension comes first
    assert spec(("layers", "embed", "latent")) == jax.P(None, ("fsdp", "expert"), None)  # MLA down-projection
    assert spec(("layers", "latent", "heads"))[:2] == (None, ("fsdp", "expert"))  # MLA up-projection
    # With the shape known, an optional axis goes only where the dimension still splits evenly.
    assert spec(("embed", "mlp"), shape=(12, 8)) == jax.P("fsdp", None)  # 12 splits 2 ways, not 8
    assert spec(("latent", "heads"), shape=(6, 8))[0] == "fsdp"
    assert spec(("latent", "heads"), shape=(3, 8))[0] is None


def test_optional_axes_from_overrides_yield_to_required_ones():
    rules = rules_lib.make_rules("fsdp", rules_lib.parse_overrides("params.embed=fsdp?,params.mlp=fsdp"))
    assert rules_lib.logical_to_mesh_spec(("embed", "mlp"), rules.params, ("fsdp",)) == jax.P(None, "fsdp")
    assert rules_lib.logical_to_mesh_spec(("embed", "vocab"), rules.params, ("fsdp",)) == jax.P("fsdp", None)


def test_overrides_parse_and_validate():
    rules = rules_lib.make_rules("fsdp", rules_lib.parse_overrides("mlp=tensor,batch=data+fsdp,params.embed="))
    params, acts = dict(rules.params), dict(rules.activations)
    assert params["mlp"] == acts["mlp"] == ("tensor",)
    assert acts["batch"] == ("data", "fsdp") and params["embed"] == ()
    with pytest.raises(ValueError, match="unknown logical axis"):
        rules_lib.make_rules("fsdp", {"widht": "fsdp"})
    with pytest.raises(ValueError, match="prefix"):
        rules_lib.make_rules("fsdp", {"weights.embed": "fsdp"})
    with pytest.raises(ValueError, match="one of dp, fsdp, tp, sp"):
        rules_lib.make_rules("zero")


@pytest.mark.devices(8)
def test_constrain_is_a_no_op_without_mesh_and_shards_with_one():
    x = jnp.ones((8, 4, 16))
    assert partition.constrain(x, ("batch", "seq", "embed")) is x
    mesh = mesh_lib.make_mesh("data:2,fsdp:4")
    with jax.set_mesh(mesh), partition.use_rules(rules_lib.make_rules("fsdp")):
        y = jax.jit(lambda a: partition.constrain(a * 2, ("batch", "seq", "embed")))(x)
    assert y.sharding.is_equivalent_to(jax.NamedSharding(mesh, jax.P(("data", "fsdp"))), 3)
    np.testing.assert_array_equal(y, 2 * x)


@pytest.mark.devices(8)
def test_state_shardings_follow_parameters():
    import optax

    mesh = mesh_lib.make_mesh("fsdp:8")
    params = {"w": jnp.ones((16, 8)), "b": jnp.ones((8,))}
    shardings = {"w": jax.NamedSharding(mesh, jax.P("fsdp", None)), "b": jax.NamedSharding(mesh, jax.P())}
    abstract = jax.eval_shape(optax.adamw(1e-3).init, params)
    out = partition.state_shardings(abstract, params, shardings, mesh)
    mu = out[0].mu
    assert mu["w"] == shardings["w"] and mu["b"] == shardings["b"]
    assert out[0].count.spec == jax.P()
