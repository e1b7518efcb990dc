"""Pipeline parallelism (`lm.parallel.pipeline`): every schedule equals one device on 8 CPU devices.

Each case jits the model's loss and gradients once per mesh (`tiny` with 8 layers and packed
documents) and steps AdamW and Muon on them from the same initial parameters, as
`tests/sharding/test_checkpoint_any_mesh.py` does: the first step's gradients must equal one
device's to fp32 rounding and three steps' losses agree within 1e-5 (10 steps: the check in
`experiments/bench_pipeline.py`). To keep the suite short, AdamW and Muon step under ZB-H1 on
`stage:4,data:2` and the other cases are checked on their gradients. The ``vocab-*`` cases run every
schedule with the embedding and head split over ``stage`` (`lm.parallel.vocab_parallel`); SkipPipe's
executor (`pipeline.run_paths`) is checked against GPipe's loop and a one-device run of each path.
"""

import functools
import itertools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import checkpointing, run_spec, train_lib
from experiments.cli import UsageError
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib
from lm.loss import cross_entropy, next_token_loss
from lm.parallel import (
    pipeline,
    pipeline_1f1b,
    pipeline_schedule,
    skip_schedule,
    vocab_parallel,
)
from lm.transformer import scan_blocks
from optim import registry
from sharding import partition

pytestmark = pytest.mark.devices(8)

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SEPARATOR, BATCH, SEQ_LEN, STEPS = 7, 8, 16, 3
ONE_DEVICE = {"mesh": "data:1", "devices": 1}
# placement, optimizers stepped on it (none: the first step's gradients only, to keep the suite short)
CASES = {
    "gpipe-stage4-data2": ({"mesh": "stage:4,data:2", "model.pipeline_microbatches": 4}, ()),
    "circular-stage2-data4": (
        {"mesh": "stage:2,data:4", "model.pipeline_schedule": "circular", "model.pipeline_repeats": 2, "model.pipeline_microbatches": 2},
        (),
    ),
    "1f1b-stage2-fsdp2-tensor2": (
        {"mesh": "stage:2,fsdp:2,tensor:2", "rules": "tp", "model.pipeline_schedule": "1f1b", "model.pipeline_microbatches": 4},
        (),
    ),
    "zb_h1-stage4-data2": ({"mesh": "stage:4,data:2", "model.pipeline_schedule": "zb_h1", "model.pipeline_microbatches": 4}, ("adamw", "muon")),
    "zb_h1-stage2-fsdp2-tensor2": (
        {"mesh": "stage:2,fsdp:2,tensor:2", "rules": "tp", "model.pipeline_schedule": "zb_h1", "model.pipeline_microbatches": 4},
        (),
    ),
}
# Vocabulary parallelism (lm/parallel/vocab_parallel.py): embedding and head split over `stage`, every schedule.
_VOCAB = {"mesh": "stage:4,data:2", "model.pipeline_microbatches": 4, "model.pipeline_vocab_parallel": True}
CASES |= {
    f"vocab-{schedule}-stage4-data2": ({**_VOCAB, "model.pipeline_schedule": schedule, "model.pipeline_repeats": 2 if schedule == "circular" else 1}, ())
    for schedule in pipeline.SCHEDULES
}
OPTIMIZERS = ("adamw", "muon")


def _config(placement, optimizer="adamw"):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = STEPS, BATCH, SEQ_LEN
    config.model.update({"preset": "tiny", "n_layers": 8, "document_separator": SEPARATOR})
    config.optimizer.name, config.optimizer.warmup_steps = optimizer, 1
    for key, value in placement.items():
        *block, name = key.split(".")
        (config[block[0]] if block else config)[name] = value
    return config


def _batches():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (STEPS, BATCH, SEQ_LEN + 1), dtype=np.int32)
    tokens[:, :, rng.integers(1, SEQ_LEN, 6)] = SEPARATOR  # documents that cross microbatch rows and stages
    return tokens


@functools.cache
def _initial_params():
    spec = run_spec.build_run(_config(ONE_DEVICE))
    with jax.set_mesh(spec.mesh):
        return jax.device_get(model_lib.init_params(spec.model_def, 0, spec.shardings.params))


@functools.cache
def _run(case):
    """Gradients of the first batch and ``{optimizer: (losses, final state)}`` of `STEPS` steps on one placement."""
    placement, optimizers = (ONE_DEVICE, OPTIMIZERS) if case is None else CASES[case]
    specs = {name: run_spec.build_run(_config(placement, name)) for name in optimizers}
    spec = run_spec.build_run(_config(placement))
    shardings = spec.shardings

    def loss_fn(params, tokens):
        return next_token_loss(spec.model_def, params, tokens)[0]

    def loss_and_grads(params, tokens):
        if pipeline_1f1b.active(spec.cfg):
            (loss, _), grads = pipeline_1f1b.value_and_grad(spec.model_def, params, tokens, cross_entropy)
            return loss, grads
        return jax.value_and_grad(loss_fn)(params, tokens)

    batches, out, initial = _batches(), {}, _initial_params()
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        grad_fn = jax.jit(
            loss_and_grads, in_shardings=(shardings.params, shardings.batch), out_shardings=(None, shardings.params), compiler_options=FAST_COMPILE
        )  # fmt: skip
        params = jax.device_put(initial, shardings.params)
        first_grads = jax.device_get(grad_fn(params, train_lib.global_batch(batches[0], shardings))[1])
        for name, s in specs.items():
            tx = s.tx

            def apply(p, o, g, tx=tx):
                u, o = tx.update(g, o, p)
                return optax.apply_updates(p, u), o

            update = jax.jit(apply, out_shardings=(s.shardings.params, s.shardings.state["opt_state"]), compiler_options=FAST_COMPILE)
            init = jax.jit(tx.init, out_shardings=s.shardings.state["opt_state"], compiler_options=FAST_COMPILE)
            state = {"params": params, "opt_state": init(params)}
            losses = []
            for tokens in batches:
                loss, grads = grad_fn(state["params"], train_lib.global_batch(tokens, shardings))
                state["params"], state["opt_state"] = update(state["params"], state["opt_state"], grads)
                losses.append(float(loss))
            out[name] = (np.array(losses), state)
    return first_grads, out


@pytest.mark.parametrize("case", CASES)
def test_schedule_equals_one_device(case):
    grads_1, runs_1 = _run(None)
    grads, runs = _run(case)
    for (path, g), g_1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1), strict=True):
        error = np.linalg.norm(g - g_1) / np.linalg.norm(g_1)
        assert error < 1e-5, (jax.tree_util.keystr(path), error)
    for name in CASES[case][1]:
        np.testing.assert_allclose(runs[name][0], runs_1[name][0], rtol=1e-5, err_msg=name)
        assert runs[name][0][-1] < runs[name][0][0]  # it trained


def test_block_parameters_and_state_split_over_stage():
    _, runs = _run("zb_h1-stage4-data2")
    state = runs["adamw"][1]
    kernel = state["params"]["blocks"]["mlp"]["down_proj"]["kernel"]
    assert kernel.sharding.spec[0] == "stage" and kernel.shape[0] == 8
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim == 3 and x.shape == kernel.shape]
    assert moments and all(m.sharding.spec[0] == "stage" for m in moments)


@pytest.mark.parametrize("saved_on, restored_on", [("zb_h1-stage4-data2", None), (None, "1f1b-stage2-fsdp2-tensor2")])
def test_checkpoint_moves_between_pipeline_and_plain_meshes(tmp_path, saved_on, restored_on):
    state = _run(saved_on)[1]["muon"][1]
    mgr = checkpointing.manager(tmp_path, keep=1, every=1)
    checkpointing.save(mgr, STEPS, state, {}, {"optimizer": "muon"}, force=True)
    mgr.wait_until_finished()
    spec = run_spec.build_run(_config(ONE_DEVICE if restored_on is None else CASES[restored_on][0], "muon"))
    target = train_lib.abstract_state(spec.model_def, spec.tx, spec.shardings)
    target = {"params": target["params"], "opt_state": target["opt_state"]}
    with jax.set_mesh(spec.mesh):
        step, restored, _ = checkpointing.restore(mgr, target, {"optimizer": "muon"})
    assert step == STEPS
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored["params"]), jax.device_get(state["params"]))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored["opt_state"]), jax.device_get(state["opt_state"]))
    stages = spec.mesh.shape.get("stage", 1)
    assert restored["params"]["blocks"]["attn"]["q_proj"]["kernel"].sharding.shard_shape((8, 128, 128))[0] == 8 // stages


@pytest.mark.parametrize(
    "keys, match",
    [
        ({"model.n_layers": 6}, r"n_layers=6 does not split into stage:4 x model.pipeline_repeats=1 = 4 layer groups; use n_layers divisible by 4 \(e.g. 4 or 8\)"),
        ({"model.pipeline_microbatches": 3}, r"microbatches in \[1, 2, 4\]"),
        ({"model.pipeline_schedule": "circular", "model.pipeline_repeats": 2, "model.pipeline_microbatches": 2}, "needs microbatches >= stages"),
        ({"model.scan_layers": False}, "set model.scan_layers=True"),
        ({"optimizer.name": "muon_clip"}, "track_attn_logits"),
        ({"model.pipeline_schedule": "pipedream"}, "is not one of gpipe, circular, 1f1b, zb_h1"),
        ({"optimizer.name": "diloco", "replicas": "data"}, "does not run beside a stage axis"),
        ({"model.pipeline_vocab_parallel": True, "model.vocab_size": 322}, r"use a vocab_size divisible by 4 \(e.g. 324\)"),
        ({"model.pipeline_skip_rate": 0.5}, r"at most 1 can be skipped .* use a skip rate <= 0.25"),
        ({"model.pipeline_skip_rate": 0.25, "model.pipeline_schedule": "1f1b"}, "runs under pipeline_schedule=gpipe, not 1f1b"),
    ],
)
def test_run_spec_names_what_does_not_run(keys, match):
    config = _config({"mesh": "stage:4,data:2", **keys}, keys.get("optimizer.name", "adamw"))
    with pytest.raises(UsageError, match=match):
        run_spec.build_run(config)


@pytest.mark.parametrize("stages, microbatches, repeats", [(4, 4, 1), (4, 16, 1), (2, 8, 1), (4, 4, 2), (4, 8, 3)])
def test_tick_table_bubble_matches_the_formula(stages, microbatches, repeats):
    table = pipeline.forward_table(stages, microbatches, repeats)
    assert pipeline.bubble_fraction(table) == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))
    for stage in range(stages):  # every item once per stage, in order
        assert table[:, stage][table[:, stage] >= 0].tolist() == list(range(repeats * microbatches))


@pytest.mark.parametrize("schedule", pipeline_schedule.SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (4, 2), (4, 4), (4, 16), (8, 32)])
def test_tick_table_runs_every_op_once_after_its_inputs(schedule, stages, microbatches):
    ops, micro = pipeline_schedule.tick_table(schedule, stages, microbatches)
    split = schedule == "zb_h1"
    kinds = (
        (pipeline_schedule.FORWARD, pipeline_schedule.BACKWARD_INPUT, pipeline_schedule.BACKWARD_WEIGHT)
        if split
        else (pipeline_schedule.FORWARD, pipeline_schedule.BACKWARD)
    )
    assert set(np.unique(ops)) <= {pipeline_schedule.IDLE, *kinds}
    tick = {}  # (op, microbatch, stage) -> the one tick it runs on
    for kind in kinds:
        for stage in range(stages):
            ran = micro[:, stage][ops[:, stage] == kind]
            assert sorted(ran.tolist()) == list(range(microbatches)), (kind, stage)
            tick |= {(kind, int(m), stage): int(t) for t, m in zip(np.flatnonzero(ops[:, stage] == kind), ran, strict=True)}
    backward = kinds[1]
    for stage in range(stages):
        for m in range(microbatches):
            if stage:  # an op sees the other stages' results of earlier ticks only
                assert tick[(pipeline_schedule.FORWARD, m, stage)] > tick[(pipeline_schedule.FORWARD, m, stage - 1)]
            if stage + 1 < stages:
                assert tick[(backward, m, stage)] > tick[(backward, m, stage + 1)]
            assert tick[(backward, m, stage)] > tick[(pipeline_schedule.FORWARD, m, stage)]
            if split:
                assert tick[(pipeline_schedule.BACKWARD_WEIGHT, m, stage)] > tick[(backward, m, stage)]
    s, m = stages, microbatches
    flight = pipeline_schedule.in_flight(ops, micro)
    if split:  # ZB-H1: every stage holds S microbatches; a third of 1F1B's idle share in unit-time ops
        assert flight.tolist() == [min(s, m)] * s
        bubble = pipeline_schedule.bubble_fraction(ops)
        if m >= s:  # fewer microbatches leave too few Ws to fill the cool-down
            assert bubble == pytest.approx((s - 1) / (3 * m + s - 1))
        assert bubble < (s - 1) / (m + s - 1)
        assert pipeline_schedule.buffer_slots(ops, micro) == (min(s, m), min(s, m))
    else:  # 1F1B: stage s holds S - s microbatches (before unit-time ticks, 2(S - 1 - s) + 1)
        assert flight.tolist() == [min(s - stage, m) for stage in range(s)]
        assert pipeline_schedule.bubble_fraction(ops) == pytest.approx((s - 1) / (m + s - 1))
        assert pipeline_schedule.buffer_slots(ops, micro) == (min(s, m), 1)


@pytest.mark.parametrize(
    "name", sorted(n for n, c in registry.OPTIMIZERS.items() if not c.replica_local and "attn_max_logits" not in c.extra_args)
)
def test_every_optimizer_places_its_state_with_its_stage(name):
    """Under ``stage:4,data:2`` the state of a block parameter is split over ``stage`` like the parameter.

    Replica-local optimizers and those that need the attention logits are usage errors beside a
    ``stage`` axis (`test_run_spec_names_what_does_not_run`)."""
    spec = run_spec.build_run(_config({"mesh": "stage:4,data:2"}, name))
    kernel = spec.shardings.params["blocks"]["mlp"]["up_proj"]["kernel"]
    assert kernel.spec[0] == "stage"
    state = jax.tree_util.tree_leaves_with_path(spec.shardings.state["opt_state"])
    mirrors = [s for path, s in state if "up_proj" in jax.tree_util.keystr(path) and s.spec and s.spec[0] == "stage"]
    assert mirrors, [(jax.tree_util.keystr(p), s.spec) for p, s in state if "up_proj" in jax.tree_util.keystr(p)]


@pytest.mark.parametrize("schedule, ticks", [("gpipe", 4 + 4 - 1), ("1f1b", 2 * (4 + 4 - 1)), ("zb_h1", 3 * 4 + 4 - 1)])
def test_train_step_runs_the_schedule_in_force(schedule, ticks):
    """`train_lib.make_train_step` takes 1F1B's and ZB-H1's own loss and gradients (loops of their tables' ticks,
    carrying buffers of the tables' sizes) and differentiates GPipe's forward loop (M + S - 1 ticks); evaluation
    runs the forward loop under all three."""
    spec = run_spec.build_run(_config({"mesh": "stage:4,data:2", "model.pipeline_schedule": schedule}))
    batch = jax.ShapeDtypeStruct((BATCH, SEQ_LEN + 1), np.int32, sharding=spec.shardings.batch)
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.abstract_state(spec.model_def, spec.tx, spec.shardings)
        step = jax.make_jaxpr(train_lib.make_train_step(spec.model_def, spec.tx))(state, batch)
        evaluation = jax.make_jaxpr(train_lib.make_eval_step(spec.model_def))(state["params"], batch)
    loops = lambda jaxpr: {int(n) for n in re.findall(r"length=(\d+)", str(jaxpr))}  # noqa: E731
    gpipe_ticks = 4 + 4 - 1
    assert ticks in loops(step) and (gpipe_ticks in loops(step)) == (schedule == "gpipe")
    assert gpipe_ticks in loops(evaluation)
    if schedule != "gpipe":  # microbatch-sized buffers in the loop's carry: kept inputs, output gradients, stage 0's dx
        (loop,) = [e for e in _equations(step.jaxpr) if e.primitive.name == "scan" and e.params["length"] == ticks]
        carry = loop.params["jaxpr"].in_avals[loop.params["num_consts"] : loop.params["num_consts"] + loop.params["num_carry"]]
        microbatch = (BATCH // 4, SEQ_LEN, spec.cfg.d_model)
        slots = pipeline_schedule.buffer_slots(*pipeline_schedule.tick_table(schedule, 4, 4))
        assert sorted(a.shape[0] for a in carry if a.shape[1:] == microbatch) == sorted((*slots, 4))


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def test_vocab_parallel_splits_the_vocabulary_layers_over_stage():
    """Under ``model.pipeline_vocab_parallel`` stage ``s`` stores a quarter of the table (and of its optimizer state);
    without it every stage holds the whole table (the imbalance the paper removes)."""
    plain, split = (run_spec.build_run(_config({**_VOCAB, "model.pipeline_vocab_parallel": on})) for on in (False, True))
    table = lambda spec: spec.shardings.params["embed"]["embedding"]  # noqa: E731
    shape = split.model_def.abstract_params["embed"]["embedding"].shape
    assert table(plain).shard_shape(shape) == shape
    assert table(split).spec[0] == "stage" and table(split).shard_shape(shape) == (shape[0] // 4, shape[1])
    state = jax.tree.leaves(split.shardings.state["opt_state"], is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    assert sum(s.spec[:1] == ("stage",) and s.shard_shape(shape) == (shape[0] // 4, shape[1]) for s in state if len(s.spec) == 2) >= 2



@pytest.mark.parametrize("vocab_first", [True, False])
def test_vocab_parallel_cross_entropy_equals_the_whole_softmax(vocab_first):
    """The S and T passes over four vocabulary slices give `cross_entropy`'s loss, metrics and gradients (z-loss on),
    tied ``(V, d)`` and untied ``(d, V)`` heads; logits spread so that every slice's max differs."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(64, 16)) * np.linspace(0.1, 3, 64)[:, None], jnp.float32)
    head = head if vocab_first else head.T
    targets = jnp.asarray(rng.integers(0, 64, (4, 8)), jnp.int32)
    logits = lambda h, w: jnp.einsum("bsd,vd->bsv" if vocab_first else "bsd,dv->bsv", h, w)  # noqa: E731
    whole = lambda h, w: cross_entropy(logits(h, w), targets, z_loss=1e-2)  # noqa: E731
    split = lambda h, w: vocab_parallel.cross_entropy(h, w, targets, z_loss=1e-2, vocab_first=vocab_first)  # noqa: E731
    spec = run_spec.build_run(_config({"mesh": "stage:4,data:2"}))
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        got = jax.jit(jax.value_and_grad(split, argnums=(0, 1), has_aux=True))(h, head)
    want = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(h, head)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want)


@pytest.mark.parametrize("stages", [4, 8])
def test_skip_paths_follow_the_papers_constraints(stages):
    rate = skip_schedule.max_skips(stages) / stages
    route = skip_schedule.paths(stages, 64, rate, seed=1)
    for path in route:
        skipped = sorted(set(range(stages)) - set(path))
        assert path[0] == 0 and path[-1] == stages - 1 and list(path) == sorted(path)
        assert len(skipped) == skip_schedule.max_skips(stages) and all(b - a > 1 for a, b in itertools.pairwise(skipped))
    assert len(set(route)) > 1  # drawn, not one fixed path
    assert skip_schedule.paths(stages, 8, 0.0) == [tuple(range(stages))] * 8


def test_skip_tick_table_is_gpipes_at_rate_zero_and_shorter_with_skips():
    s, m = 4, 8
    items, sources = skip_schedule.tick_table(skip_schedule.paths(s, m, 0.0), s)
    np.testing.assert_array_equal(items, pipeline.forward_table(s, m))
    assert skip_schedule.offsets(sources) == (1,)
    route = [(0, 2, 3), (0, 1, 3), (0, 2, 1, 3), (0, 1, 2, 3)] * 2  # skips, and one reordered path
    items, sources = skip_schedule.tick_table(route, s)
    arrived = skip_schedule.arrivals(items, sources)
    for i, path in enumerate(route):  # each hop once, on its stage, after the previous hop, its input there in time
        ticks = [int(np.flatnonzero(items[:, stage] == i)[0]) for stage in path]
        assert (items == i).sum() == len(path) and ticks == sorted(ticks) and len(set(ticks)) == len(ticks)
        for (a, b), (ta, tb) in zip(itertools.pairwise(path), itertools.pairwise(ticks), strict=True):
            assert sources[tb, b] == a and arrived[ta + 1, b, skip_schedule.offsets(sources).index(b - a)] == i
    full, (items, _) = pipeline.forward_table(s, m), skip_schedule.tick_table(skip_schedule.paths(s, m, 0.25), s)
    assert (items >= 0).sum() == 3 * m < (full >= 0).sum()  # one stage of four skipped per microbatch
    assert items.shape[0] < full.shape[0] and skip_schedule.throughput(items) > skip_schedule.throughput(full)


def test_skip_executor_equals_gpipe_bit_for_bit_and_each_path_on_one_device():
    """`pipeline.run_paths` with every path full is GPipe's loop to the bit (values and gradients); with skipped and
    reordered paths it equals each microbatch run through its path's layer groups on one device."""
    cfg = config_lib.from_preset("tiny", n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, pipeline_microbatches=2)
    model_def = model_lib.define(cfg)
    blocks = nnx.merge(model_def.graphdef, jax.device_get(model_lib.init_params(model_def, 0))).blocks
    graph, state = nnx.split(blocks)
    x = jax.random.normal(jax.random.key(1), (4, 8, cfg.d_model))
    run = lambda b, h, seg: scan_blocks(cfg, b, h, seg)[0]  # noqa: E731
    route = [(0, 2, 1, 3), (0, 1, 3)]  # a reordered path and a skip

    def one_device(b, x):
        micro, out = pipeline.to_microbatches(x, 2), []
        for i, path in enumerate(route):
            h = micro[i]
            for s in path:
                h = run(nnx.merge(graph, jax.tree.map(lambda w, s=s: w[s : s + 1], nnx.state(b))), h, None)
            out.append(h)
        return pipeline.from_microbatches(jnp.stack(out))

    def loss(fn):
        return jax.value_and_grad(lambda w, x: jnp.sum(jnp.sin(fn(nnx.merge(graph, w), x))), argnums=(0, 1))

    runs = {
        "gpipe": lambda b, x: pipeline.run_stack(b, x, None, run, cfg),
        "full": lambda b, x: pipeline.run_paths(b, x, None, run, [tuple(range(4))] * 2),
        "skip": lambda b, x: pipeline.run_paths(b, x, None, run, route),
        "one_device": one_device,
    }
    spec = run_spec.build_run(_config({"mesh": "stage:4,data:2"}))
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        out = jax.jit(lambda w, x: {k: loss(f)(w, x) for k, f in runs.items()}, compiler_options=FAST_COMPILE)(state, x)
    jax.tree.map(np.testing.assert_array_equal, out["full"], out["gpipe"])
    assert not np.allclose(out["skip"][0], out["gpipe"][0])
    for a, b in zip(jax.tree.leaves(out["skip"]), jax.tree.leaves(out["one_device"]), strict=True):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)

