"""`--config.profile=START:STOP` traces those steps; `experiments.profile_summary` tables the trace by kernel category."""

import gzip
import json

import jax
import pytest

from experiments import cli, hlo_bytes, profiling, trainer
from experiments.configs import default


def test_profiled_run_traces_its_steps_and_summarises_on_cpu(tmp_path, capsys):
    config = default.get_config()
    config.update_from_flattened_dict(
        {"steps": 5, "batch_size": 4, "data.seq_len": 16, "eval_every": 100, "eval_batches": 1, "log_every": 1,
         "checkpoint_every": 100, "devices": 1, "profile": "2:3", "optimizer.warmup_steps": 1}
    )  # fmt: skip
    trainer.run(config, tmp_path, interrupt_at=3)  # traces steps 2 and 3
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # what TensorBoard / XProf read
    events = profiling.load_events(tmp_path)
    summary = profiling.summarize(events, top=5)
    assert summary.steps == 2
    assert summary.by_category["matrix products"][0] > 0
    assert len(summary.top) == 5 and all(op for _, op, _, _, _ in summary.top)  # each kernel names its HLO op
    table = profiling.format_summary(summary)
    assert "2 traced step(s)" in table and "idle" in table and summary.top[0][1] in table

    config.profile = "2:5"  # resumed after step 3: step 4 compiles, step 5 is left to trace
    trainer.run(config, tmp_path)
    assert "steps 5 to 5 are traced" in capsys.readouterr().err
    assert len(list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))) == 2
    assert profiling.summarize(profiling.load_events(tmp_path)).steps == 1  # the newest trace


@pytest.mark.parametrize(
    "window, resumed_at, traced, message",
    [
        ((3, 5), 0, (3, 5), None),
        ((1, 3), 0, (2, 3), "profile=1:3: step 1 compiles: steps 2 to 3 are traced"),  # was: traced the compile
        ((1, 1), 0, None, "profile=1:1: step 1 compiles: no step of the window is left to trace (give a later one, e.g. --config.profile=2:2)"),
        ((3, 5), 1, (3, 5), None),  # its first step, 2, compiles outside the window
        ((3, 5), 2, (4, 5), "profile=3:5: resumed after step 2, and step 3 compiles: steps 4 to 5 are traced"),
        ((3, 5), 4, None, "profile=3:5: resumed after step 4, and step 5 compiles: no step of the window is left to trace (give a later one, e.g. --config.profile=6:8)"),
        ((3, 5), 7, None, "profile=3:5: resumed after step 7, and step 8 compiles: no step of the window is left to trace (give a later one, e.g. --config.profile=9:11)"),
    ],
)
def test_a_window_holding_the_runs_first_step_traces_the_steps_after_it_and_says_so(tmp_path, capsys, window, resumed_at, traced, message):
    """A run's first step compiles: a fresh run's step 1, a resumed run's step after ``resumed_at``
    (a resumed run waited for START and traced nothing; a fresh one traced the compile)."""
    trace = profiling.StepTrace(window, tmp_path, resumed_at=resumed_at)
    assert trace.steps == traced
    assert capsys.readouterr().err.strip() == (message or "")


def _gpu_trace(path):
    """A GPU-shaped trace: a device process with a stream line, derived "XLA Ops" line, host events."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    kernels = [  # (name, hlo_op, start, duration): 10 us idle between the copy and the reduction
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "custom-call.3", 0, 30),
        ("nvjet_sm90_tss_128x128_64x6_1x2_h_badd_NTT", "command_buffer_7", 30, 10),  # cuBLAS 12.9+'s gemms, bias-add epilogue
        ("cudnn_generated_fmha_sm90_fprop", "custom-call.9", 40, 20),
        ("input_dynamic_update_slice_fusion", "dynamic-update-slice.2", 60, 10),
        ("loop_convert_fusion", "convert.1", 70, 5),
        ("input_reduce_fusion", "reduce.4", 85, 5),
        ("ncclDevKernel_AllReduce_Sum_f32", "all-reduce.1", 90, 10),
    ]
    events = meta + [
        {"ph": "X", "pid": 1, "tid": 7, "ts": s, "dur": d, "name": n, "args": {"hlo_op": op}} for n, op, s, d in kernels
    ]
    events += [
        {"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": 40, "name": "custom-call.3", "args": {"hlo_op": "custom-call.3"}},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 100, "name": "train", "args": {"step_num": "4"}},
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_gpu_trace_categories_and_idle(tmp_path):
    _gpu_trace(tmp_path / "host.trace.json.gz")
    summary = profiling.summarize(profiling.load_events(tmp_path))
    got = {c: t for c, (t, _) in summary.by_category.items() if t}
    assert got == {"matrix products": 40, "attention": 20, "copies": 10, "elementwise": 5, "reductions": 5, "collectives": 10, "idle": 10}
    assert summary.steps == 1 and summary.top[0][:3] == ("sm90_xmma_gemm_bf16bf16_bf16f32", "custom-call.3", "matrix products")
    assert ("nvjet_sm90_tss_128x128_64x6_1x2_h_badd_NTT", "command_buffer_7", "matrix products") in [t[:3] for t in summary.top]


@pytest.mark.parametrize("text", ["3", "0:2", "5:4", "a:b"])
def test_bad_profile_steps_name_the_fix(text):
    with pytest.raises(ValueError, match="START:STOP"):
        profiling.parse_steps(text)


def test_a_run_refuses_a_profile_it_cannot_trace_and_a_stop_before_its_first_step_before_writing(tmp_path):
    config = default.get_config()
    config.steps = 4
    for profile, message in (("5:4", "START:STOP"), ("10:12", r"starts after the run's last step \(steps=4\), so it would trace nothing")):
        config.profile = profile
        with pytest.raises(cli.UsageError, match=message):
            trainer.run(config, tmp_path / "w")
    config.profile = ""
    with pytest.raises(cli.UsageError, match="--stop_after=0 must be >= 1"):  # ran every step before
        trainer.run(config, tmp_path / "w", interrupt_at=0)
    assert not (tmp_path / "w").exists()


def test_rolled_layer_loop_moves_only_the_carry_and_attentions_layout(default_emitters):
    """The scanned step (one block per iteration, as on accelerators) under full remat: the forward loop
    writes one stack (each layer's input) and the backward loop none; activation-sized copies per
    iteration stay at the loop carry plus K and V laid out head-major for XLA's attention (3).
    Measured 2026-11-27 (docs/benchmarks.md 15): without remat the forward loop writes 13 stacks."""
    import jax.numpy as jnp
    import optax

    from experiments import train_lib
    from lm import config as config_lib
    from lm import model as model_lib

    batch, seq = 3, 40  # distinct from every model width
    model_def = model_lib.define(config_lib.from_preset("tiny", scan_unroll=1, remat="full"))
    tx = optax.sgd(0.1)
    counters = {k: jax.ShapeDtypeStruct((), jnp.int32) for k in ("step", "bad_streak", "skipped")}
    state = {"params": model_def.abstract_params, "opt_state": jax.eval_shape(tx.init, model_def.abstract_params), **counters}
    step = jax.jit(train_lib.make_train_step(model_def, tx))
    # XLA's own emitters (the suite's fast compiles use the legacy ones, which leave two more loops)
    compiled = step.lower(state, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)).compile(default_emitters)
    forward, backward = hlo_bytes.loop_buffer_moves(compiled.as_text(), (batch, seq))
    assert forward["stack_writes"] == 1 and backward["stack_writes"] == 0
    assert forward["copies"] <= 3 and backward["copies"] <= 3
