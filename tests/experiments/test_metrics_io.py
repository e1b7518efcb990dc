"""A run's metric outputs: the loss plot, TensorBoard hparams, Weights & Biases (when installed)."""

import json
import math
import struct

import pytest

from experiments import compare_optimizers, metrics_io

RECORDS = [
    {"step": 1, "loss": 5.0},
    {"step": 2, "loss": 4.0, "val_loss": 4.2, "val_bits_per_byte": 4.2 / math.log(2) * 0.3},
    {"step": 3, "loss": 3.0, "val_loss": 3.5, "val_bits_per_byte": 3.5 / math.log(2) * 0.3},
]


def test_loss_plot_has_a_title_and_reads_bits_per_byte_off_the_loss_axis():
    fig = metrics_io.loss_figure(RECORDS, "runs/x: tiny + adamw")
    ax = fig.axes[0]
    assert ax.get_title() == "runs/x: tiny + adamw"
    assert [a for a in fig.axes if a is not ax and a.lines] == []  # no second curve on a scale of its own
    (right,) = ax.child_axes
    scale = 0.3 / math.log(2)
    low, high = ax.get_ylim()
    assert right.get_ylim() == pytest.approx((low * scale, high * scale))
    assert "bits / byte" in right.get_ylabel()


def test_summary_and_config_go_to_tensorboard_hparams(tmp_path):
    config = {"optimizer": {"name": "adamw", "learning_rate": 0.003, "adamw": {"b1": 0.9}}, "data": {"separator_id": None}}
    writer = metrics_io.MetricsWriter(tmp_path, config=config)
    writer.write(RECORDS[1])
    writer.write_summary({"final_val_loss": 3.5, "steps": 3, "mesh": {"data": 1}, "mfu_peak_source": "x"})
    writer.close()
    assert metrics_io.flat_hparams(config) == {"optimizer.name": "adamw", "optimizer.learning_rate": 0.003, "optimizer.adamw.b1": 0.9, "data.separator_id": "None"}
    (events,) = (tmp_path / "tensorboard" / "hparams").glob("events.out.tfevents.*")
    data = events.read_bytes()
    assert b"optimizer.learning_rate" in data and b"optimizer.adamw.b1" in data and b"summary/final_val_loss" in data


def _events(path):
    """The `Event` protos of a TensorBoard event file (TFRecord framing: length, its CRC, data, its CRC)."""
    from tensorboardX.proto import event_pb2

    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    return events


def test_a_resumed_run_purges_tensorboards_events_after_its_checkpoint(tmp_path):
    """As ``metrics.jsonl`` drops the records past the restored step, TensorBoard is told to hide them (a session
    start at the next step): they were logged by the preempted process and are logged again (were: two curves)."""
    writer = metrics_io.MetricsWriter(tmp_path)
    for record in RECORDS:
        writer.write(record)
    writer.close()
    resumed = metrics_io.MetricsWriter(tmp_path, resume_step=1)
    resumed.write(RECORDS[1])
    resumed.close()
    assert [r["step"] for r in metrics_io.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    first, second = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # by the second, then the step
    starts = [(e.step, e.session_log.status) for f in (first, second) for e in _events(f) if e.HasField("session_log")]
    assert starts == [(1, 1), (2, 1)]  # SessionLog.START: a fresh run hides everything of an earlier one, a resume what follows its step


def test_weights_and_biases_mirrors_a_run_offline(tmp_path):
    pytest.importorskip("wandb")
    writer = metrics_io.MetricsWriter(tmp_path, config={"steps": 3}, wandb={"project": "spmdlab-test", "mode": "offline"})
    for record in RECORDS:
        writer.write(record)
    writer.write_summary({"final_val_loss": 3.5})
    writer.close()
    assert (tmp_path / "wandb_id").is_file()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_compare_table_flags_a_best_value_on_the_edge_of_its_grid():
    tried = [{"learning_rate": lr, "warmup_steps": w} for lr in (1e-3, 3e-3, 1e-2) for w in (10, 20)]
    assert compare_optimizers.grid_edges({"learning_rate": 1e-3, "warmup_steps": 20}, tried) == {"learning_rate": "low", "warmup_steps": "high"}
    assert compare_optimizers.grid_edges({"learning_rate": 3e-3}, [{"learning_rate": 3e-3}]) == {}  # one value: no edge to speak of
    assert compare_optimizers.grid_edges({"learning_rate": 3e-3, "warmup_steps": 10}, tried) == {"warmup_steps": "low"}
    text = compare_optimizers._setting_text({"learning_rate": 1e-3, "warmup_steps": 20}, {"learning_rate": "low"})
    assert text == "lr 0.001 (low edge), warmup 20"
    assert json.dumps(compare_optimizers.grid_edges({"learning_rate": 1e-2}, tried))  # JSON-able for results.json
