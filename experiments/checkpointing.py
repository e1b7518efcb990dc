"""Orbax checkpoints of a run: train state, data position, and what the run was.

Each checkpoint holds three items: ``state`` (params, optimizer state, counters; restored into the
*current* run's shardings, so a run can move to another mesh), ``data`` (the iterator position) and
``meta`` (model config, optimizer name and data settings, checked before anything is restored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointMismatch(ValueError):
    """The workdir holds a checkpoint of a different run."""


def manager(workdir: str | Path, *, keep: int, every: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=max(every, 1), enable_async_checkpointing=True, create=True
    )
    return ocp.CheckpointManager(Path(workdir).absolute() / "checkpoints", options=options)


def save(mgr: ocp.CheckpointManager, step: int, state: Any, data_state: dict, meta: dict, *, force: bool = False) -> bool:
    """Saves asynchronously (``force`` ignores the save interval); returns whether a save started."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
    )
    return mgr.save(step, args=args, force=force)


def _diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += _diff(saved.get(key), current.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == current else [f"{prefix[:-1]}: checkpoint {saved!r} vs now {current!r}"]


def restore_latest(mgr: ocp.CheckpointManager, target: Any, meta: dict) -> tuple[int, Any, dict] | None:
    """Restores the newest checkpoint into ``target`` (abstract arrays with shardings).

    Returns:
      ``(step, state, data_state)``, or None when there is no checkpoint.

    Raises:
      CheckpointMismatch: the checkpoint's meta differs from ``meta`` (another model or optimizer).
    """
    step = mgr.latest_step()
    if step is None:
        return None
    saved_meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    differences = _diff(saved_meta, meta)
    if differences:
        raise CheckpointMismatch(
            f"{mgr.directory} holds a checkpoint of a different run ({'; '.join(differences[:4])}); "
            "use a fresh --workdir, or the checkpoint's original config"
        )
    restored = mgr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    )
    return step, restored["state"], restored["data"]
