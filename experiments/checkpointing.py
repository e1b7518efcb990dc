"""Orbax checkpoints of a run: train state, data position, and what the run was.

Each checkpoint holds three items: ``state`` (params, optimizer state, counters; restored into the
*current* run's shardings, so a run can move to another mesh), ``data`` (the iterator position) and
``meta`` (model config, optimizer name and data settings, checked before anything is restored).

A step whose files are damaged (truncated, corrupt, a missing piece) is reported as a
`CheckpointUnreadable` naming the step and the way out: delete that step's folder, or resume from
an earlier step (``restore(..., step=N)``, the trainer's ``--restore_step``). A read that fails for
a reason outside the files (storage unreachable or refusing access, memory exhausted) is a
`CheckpointUnreadable` that says the files are not known to be damaged and names the cause to fix,
never deletion; any other error is raised as it is (a bug, not a checkpoint's fault). Nothing falls
back to an earlier step or to a fresh start by itself; only a workdir whose saves were all cut short
(orbax's uncommitted temporary folders) starts afresh, with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from experiments import storage

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that this run cannot resume from; the message names the fix."""


class CheckpointMismatch(CheckpointError):
    """The workdir holds a checkpoint of a different run."""


class CheckpointUnreadable(CheckpointError):
    """A saved step is corrupt, truncated or incomplete."""


def manager(workdir: str | epath.PathLike, *, keep: int | None, every: int) -> ocp.CheckpointManager:
    """The run's orbax manager of `workdir/checkpoints`, local or ``gs://`` (``keep`` None: every step is kept).

    A save is written to a temporary folder and renamed to its step when every process has written
    (orbax's atomic finalize; on GCS, a commit marker file): a save cut short is never a step."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=max(every, 1), enable_async_checkpointing=True, create=True
    )
    return ocp.CheckpointManager(storage.workdir(workdir) / "checkpoints", options=options)


def latest_step(workdir: str | epath.PathLike) -> int | None:
    """The newest committed checkpoint step in ``workdir`` (None: none), creating nothing."""
    folder = storage.workdir(workdir) / "checkpoints"
    if not folder.is_dir():
        return None
    steps = [int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(steps, default=None)


def save(mgr: ocp.CheckpointManager, step: int, state: Any, data_state: dict, meta: dict, *, force: bool = False) -> bool:
    """Saves asynchronously (``force`` ignores the save interval); returns whether a save started."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
    )
    return mgr.save(step, args=args, force=force)


def _diff(saved: Any, current: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(key path, saved value, current value)`` wherever the two metas differ."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += _diff(saved.get(key), current.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == current else [(prefix[:-1], saved, current)]


def _describe_differences(differences: list[tuple[str, Any, Any]], shown: int = 4) -> str:
    """The first ``shown`` differences, the settings both sides have first (the other optimizer's keys that only
    one side has follow from a changed ``optimizer.name``), and how many more there are."""
    ordered = sorted(differences, key=lambda d: d[1] is None or d[2] is None)
    text = "; ".join(f"{path}: checkpoint {old!r} vs now {new!r}" for path, old, new in ordered[:shown])
    return text + (f"; and {len(ordered) - shown} more" if len(ordered) > shown else "")


def _root_error(error: BaseException) -> BaseException:
    while error.__cause__ is not None:  # orbax wraps tensorstore's error, which names the file and the damage
        error = error.__cause__
    return error


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"


# tensorstore reports a failed read as ``ValueError("<absl status code>: ...")``; these codes say the files hold
# something other than what was written (a truncated chunk: OUT_OF_RANGE; a corrupt or missing one: DATA_LOSS,
# FAILED_PRECONDITION, NOT_FOUND; malformed metadata: INVALID_ARGUMENT).
_DAMAGE_CODES = frozenset({"DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION", "NOT_FOUND", "INVALID_ARGUMENT"})
# ... and these that the files could not be reached, or the restore could not hold them: the fix is elsewhere.
_OUTSIDE_CODES = {
    "PERMISSION_DENIED": "check that this process may read {where}",
    "UNAUTHENTICATED": "check this process's credentials for {where}",
    "UNAVAILABLE": "the storage did not answer: rerun once {where} is reachable",
    "DEADLINE_EXCEEDED": "the storage did not answer in time: rerun once {where} is reachable",
    "ABORTED": "the read was interrupted: rerun",
    "CANCELLED": "the read was cancelled: rerun",
    "RESOURCE_EXHAUSTED": "memory ran out while restoring: rerun with more memory, or more devices to shard the state",
}


def _status_code(error: BaseException) -> str | None:
    match = re.match(r"([A-Z_]+): ", str(error))
    return match.group(1) if match else None


def _is_damage(error: BaseException) -> bool:
    if isinstance(error, (FileNotFoundError, json.JSONDecodeError)):  # a missing or malformed metadata file
        return True
    if isinstance(error, KeyError):  # orbax: 'Item "data" was not found in the checkpoint'
        return "not found in the checkpoint" in str(error)
    return isinstance(error, ValueError) and _status_code(error) in _DAMAGE_CODES


def _outside_fix(error: BaseException) -> str | None:
    """How to fix a read that failed for a reason outside the step's files (None: not such a failure)."""
    if isinstance(error, PermissionError):
        return _OUTSIDE_CODES["PERMISSION_DENIED"]
    if isinstance(error, (ConnectionError, TimeoutError)):
        return _OUTSIDE_CODES["UNAVAILABLE"]
    if isinstance(error, MemoryError):
        return _OUTSIDE_CODES["RESOURCE_EXHAUSTED"]
    return _OUTSIDE_CODES.get(_status_code(error) or "")


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first runs its pending tasks to completion."""

    def close(self) -> None:
        while pending := asyncio.all_tasks(self):
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _DrainingLoop()


@contextlib.contextmanager
def _failed_reads_finish_before_their_loop_closes():
    """Orbax reads each array in a task on a fresh loop and closes the loop when the first read fails.

    The other reads are then still pending: tensorstore completes them on its threads into a closed
    loop and prints "Event loop is closed" tracebacks (and "exception never retrieved") around our
    error. Loops made meanwhile finish their tasks before closing, so a failed restore ends quietly.
    """
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_DrainingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(policy)


def _read(mgr: ocp.CheckpointManager, step: int, read: Callable[[], T]) -> T:
    """``read()`` of checkpoint ``step``; a failure of the step's files or of their storage raises
    `CheckpointUnreadable` naming the step and the fix (deleting the step only where its files are damaged)."""
    try:
        with _failed_reads_finish_before_their_loop_closes():
            return read()
    except Exception as e:  # noqa: BLE001 (orbax and tensorstore raise many types for damaged files)
        error = _root_error(e)
        where = mgr.directory / str(step)
        if _is_damage(error):
            earlier = [s for s in mgr.all_steps() if s < step]
            if earlier:
                fix = f"delete {where} to resume from step {earlier[-1]}, or resume from it with --restore_step={earlier[-1]}"
            else:
                fix = f"delete {where} to start from step 0 (there is no earlier checkpoint)"
            raise CheckpointUnreadable(f"checkpoint step {step} cannot be read ({_describe(error)}); {fix}") from e
        if (outside := _outside_fix(error)) is not None:
            raise CheckpointUnreadable(
                f"checkpoint step {step} cannot be read now ({_describe(error)}); its files are not known to be "
                f"damaged, so keep them: {outside.format(where=where)}"
            ) from e
        raise


def _names(path: tuple) -> tuple[str, ...]:
    """A key path as plain names (orbax stores NamedTuple fields as dict keys)."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _shape_differences(state_dir: epath.Path, target: Any) -> list[str]:
    saved = ocp.StandardCheckpointHandler().metadata(state_dir)
    shapes = {_names(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        saved_shape = shapes.get(_names(path))
        if saved_shape is not None and saved_shape != tuple(leaf.shape):
            out.append(f"{'.'.join(_names(path))}: checkpoint {saved_shape} vs now {tuple(leaf.shape)}")
    return out


def read_meta(mgr: ocp.CheckpointManager, step: int) -> dict:
    """The meta saved with checkpoint ``step`` (`CheckpointUnreadable` when it cannot be read)."""
    return _read(mgr, step, lambda: mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())))["meta"]


def check_meta(mgr: ocp.CheckpointManager, step: int, meta: dict, upgrade: Callable[[dict], dict] | None = None) -> None:
    """Raises `CheckpointMismatch` when checkpoint ``step``'s meta (read through ``upgrade``, which brings an older
    checkpoint's meta to today's form) differs from ``meta`` (another model, optimizer or replica count),
    `CheckpointUnreadable` when its meta cannot be read, `CheckpointError` when ``step`` is not a saved step."""
    if step not in (steps := mgr.all_steps()):
        raise CheckpointError(f"no checkpoint at step {step} in {mgr.directory}; saved steps: {list(steps) or 'none'}")
    saved_meta = read_meta(mgr, step)
    differences = _diff(upgrade(saved_meta) if upgrade else saved_meta, meta)
    if differences:
        raise CheckpointMismatch(
            f"{mgr.directory} holds a checkpoint of a different run ({_describe_differences(differences)}); "
            "use a fresh --workdir, or the checkpoint's original config"
        )


def read_data_state(mgr: ocp.CheckpointManager, step: int) -> dict:
    """The input pipeline's state saved with checkpoint ``step`` (`CheckpointUnreadable` when it cannot be read)."""
    return _read(mgr, step, lambda: mgr.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore())))["data"]


def restore(
    mgr: ocp.CheckpointManager,
    target: Any,
    meta: dict,
    step: int | None = None,
    *,
    discard_newer: bool = True,
    upgrade: Callable[[dict], dict] | None = None,
) -> tuple[int, Any, dict] | None:
    """Restores checkpoint ``step`` (default: the newest) into ``target`` (abstract arrays with shardings).

    Restoring an earlier step than the newest deletes the newer ones (unless ``discard_newer`` is
    False, for readers such as the sampler): the run continues from ``step`` and saves its own
    checkpoints after it.

    Returns:
      ``(step, state, data_state)``, or None when there is no checkpoint and no ``step`` was asked for.

    Raises:
      CheckpointMismatch: the checkpoint's meta (read through ``upgrade``, as `check_meta`) differs from ``meta`` (another model or optimizer), or
        its arrays have other shapes than ``target`` (written by another version of the code).
      CheckpointUnreadable: the step's files are corrupt, truncated or missing.
      CheckpointError: ``step`` is not a saved step.
    """
    steps = mgr.all_steps()
    if step is None:
        if not steps:
            unfinished = ocp.path.step.tmp_checkpoints(mgr.directory)
            if unfinished:  # saves cut short: nothing was committed, so the run starts afresh, but says so
                logging.warning("%s holds only unfinished saves %s; starting from step 0", mgr.directory, sorted(unfinished))
            return None
        step = steps[-1]
    check_meta(mgr, step, meta, upgrade)
    differences = _read(mgr, step, lambda: _shape_differences(mgr.directory / str(step) / "state", target))
    if differences:
        raise CheckpointMismatch(
            f"checkpoint step {step} in {mgr.directory} holds arrays of other shapes than this run's state "
            f"({'; '.join(differences[:2])}); it was written by another version of the code: use a fresh --workdir"
        )
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
    restored = _read(mgr, step, lambda: mgr.restore(step, args=args))
    for newer in [s for s in steps if s > step and discard_newer]:
        mgr.delete(newer)
    return step, restored["state"], restored["data"]
