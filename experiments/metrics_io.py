"""A run's metric outputs: ``metrics.jsonl``, TensorBoard events and ``loss.png``."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboardX import SummaryWriter  # noqa: E402


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard.

    On resume, records past the restored step are dropped first (they were logged after the last
    checkpoint and are about to be logged again), so ``metrics.jsonl`` reads as one clean run.
    """

    def __init__(self, workdir: str | Path, *, resume_step: int = 0, enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled
        if not enabled:
            return
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._tb = SummaryWriter(str(Path(workdir) / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def plot_losses(metrics_path: str | Path, out_path: str | Path) -> None:
    """Train and validation loss against step; validation bits per byte on a second axis when logged
    (the axis on which runs of different tokenizers compare)."""
    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    bits = [(r["step"], r["val_bits_per_byte"]) for r in records if r.get("val_bits_per_byte") is not None]
    if bits:
        right = ax.twinx()
        right.plot(*zip(*bits), "s:", color="tab:green", markersize=3, label="validation bits / byte")
        right.set_ylabel("validation bits / byte")
        right.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
