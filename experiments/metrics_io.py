"""A run's metric outputs: ``metrics.jsonl``, TensorBoard events (scalars, and the config with the summary
as hparams), ``loss.png``, and optionally a Weights & Biases run (``pip install -e '.[wandb]'``; its local
files copied into a workdir in object storage when the writer closes)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from etils import epath
from tensorboardX import SummaryWriter

from experiments import storage

if TYPE_CHECKING:
    from matplotlib.figure import Figure

storage.register_tensorboard_schemes()


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard.

    On resume, records past the restored step are dropped first (they were logged after the last
    checkpoint and are about to be logged again), so ``metrics.jsonl`` reads as one clean run; TensorBoard
    gets the same as a session start at the next step (``purge_step``: it hides the earlier events of that
    step and later, as it does for a restarted PyTorch run). In object storage (no append) the file is
    rewritten whole on every record.
    """

    def __init__(
        self, workdir: str | epath.PathLike, *, resume_step: int = 0, enabled: bool = True, config: Mapping | None = None, wandb: Mapping | None = None
    ):
        """``config``: the run's resolved config (a nested mapping), recorded as TensorBoard hparams with the
        summary (`write_summary`) and as the Weights & Biases run's config. ``wandb``: the config's
        ``wandb`` block; a non-empty ``project`` mirrors every record to a Weights & Biases run in ``workdir``."""
        workdir = storage.workdir(workdir)
        self.path = workdir / "metrics.jsonl"
        self._text = "" if storage.is_remote(workdir) else None  # the whole file, where it is rewritten
        self.enabled = enabled
        self.hparams = flat_hparams(config or {})
        self._wandb = None
        if not enabled:
            return
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
            self._text = None if self._text is None else self.path.read_text()
        # the file is named by the second it opens in: the process and step tell apart two writers of one second
        suffix = f".{os.getpid()}-{resume_step}"
        self._tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=resume_step + 1, filename_suffix=suffix)
        if wandb and wandb.get("project"):
            # wandb writes local files only: into object storage they go through a local folder, copied on close.
            self._wandb_staging = storage.staging_folder(workdir, "spmdlab-wandb-")
            self._wandb = start_wandb(workdir, wandb, self.hparams, self._wandb_staging or str(workdir))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record) + "\n"
        if self._text is None:
            with self.path.open("a") as f:
                f.write(line)
        else:
            self._text += line
            self.path.write_text(self._text)
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def write_summary(self, summary: Mapping) -> None:
        """The run's config and its final numbers as TensorBoard hparams (and the Weights & Biases summary)."""
        if not self.enabled:
            return
        metrics = {f"summary/{k}": float(v) for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self._tb.add_hparams(self.hparams, metrics, name="hparams")
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str)})

    def close(self) -> None:
        if self.enabled:
            self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
                if self._wandb_staging:
                    storage.publish(self._wandb_staging, self.path.parent)


def flat_hparams(config: Mapping, prefix: str = "") -> dict[str, bool | int | float | str]:
    """A nested config as ``{"optimizer.learning_rate": 0.003, ...}``; None and lists as text (hparams take scalars)."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= flat_hparams(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value if isinstance(value, bool | int | float | str) else str(value)
    return out


def start_wandb(workdir: epath.Path, settings: Mapping, hparams: Mapping, local_dir: str) -> Any:
    """A Weights & Biases run for ``workdir`` (its files under the local folder ``local_dir``; resumed under the
    same id, kept in ``workdir``), or an `ImportError` naming the extra."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("--config.wandb.project needs Weights & Biases: pip install -e '.[wandb]'") from e
    return wandb.init(
        project=settings["project"], mode=settings.get("mode") or "online", dir=local_dir, config=dict(hparams),
        name=workdir.name, id=_wandb_id(workdir), resume="allow",
    )  # fmt: skip


def _wandb_id(workdir: epath.Path) -> str:
    """One Weights & Biases run id per workdir (kept in it), so a resumed run continues the same W&B run."""
    path = workdir / "wandb_id"
    if not path.is_file():
        path.write_text(uuid.uuid4().hex[:16])
    return path.read_text().strip()


def read_metrics(path: str | epath.PathLike) -> list[dict]:
    return [json.loads(line) for line in epath.Path(path).read_text().splitlines() if line]


def plot_losses(metrics_path: str | epath.PathLike, out_path: str | epath.PathLike, title: str = "") -> None:
    """`loss_figure` of ``metrics.jsonl`` saved as a PNG (default title: the workdir's name)."""
    fig = loss_figure(read_metrics(metrics_path), title or epath.Path(metrics_path).parent.name)
    with epath.Path(out_path).open("wb") as f:
        fig.savefig(f, format="png")


def loss_figure(records: list[dict], title: str) -> Figure:
    """Train and validation loss against step, titled ``title``. When bits per byte are logged, the right axis
    reads the same curves in bits per byte: ``bpb = loss / ln 2 * tokens_per_byte`` is one linear map, so the
    right axis is the left one relabelled (not a second curve on a scale of its own).

    A `matplotlib.figure.Figure` of its own, outside pyplot: no backend is chosen for the process (a notebook that
    imports the trainer keeps its inline plots) and nothing is left open in pyplot's figure list."""
    from matplotlib.figure import Figure  # imported when a run plots, not by every entry point

    fig = Figure(figsize=(6, 4), dpi=120)
    ax = fig.subplots()
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
    ratios = [r["val_bits_per_byte"] / r["val_loss"] for r in records if r.get("val_bits_per_byte") is not None and r.get("val_loss")]
    if ratios:
        scale = float(np.median(ratios))  # tokens per byte / ln 2, the same for every evaluation of a run
        right = ax.secondary_yaxis("right", functions=(lambda loss: loss * scale, lambda bpb: bpb / scale))
        right.set_ylabel("bits / byte (validation tokens per byte)")
    ax.set_title(title)
    fig.tight_layout()
    return fig
