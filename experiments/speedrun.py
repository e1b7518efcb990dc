r"""The GPT-2 speedrun harness: modded-nanogpt's track 1 (train to validation loss <= 3.28 on FineWeb).

    python data/cached_fineweb10B.py 9          # in a modded-nanogpt checkout: its GPT-2-token .bin shards
    python -m experiments.speedrun --workdir=runs/speedrun --config.data.train_files='data/fineweb10B/fineweb_train_*.bin' \
        --config.data.val_files='data/fineweb10B/fineweb_val_*.bin'
    python -m experiments.speedrun --config=experiments/configs/speedrun.py:tiny --workdir=runs/speedrun-tiny   # on a CPU

The run is `experiments.trainer.run` of ``experiments/configs/speedrun.py`` (`speedrun-124m` and the
record's schedule) on every device of the mesh, as any run; it stops at the first evaluation at or
below ``target_val_loss`` and reports, as the record does, the training time to it without
compilation and without evaluations, with the tokens and steps (``speedrun.json`` in the workdir).
With no ``data.train_files`` (the ``:tiny`` config) it first writes byte-level ``.bin`` shards of the
standard library's Python files (`lm.data.tokenize`) and trains on those.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import ml_collections
from absl import app, flags

from experiments import cli, trainer
from lm.data import corpus, shards
from lm.data.tokenize import MANIFEST, tokenize

REPORT_KEYS = (
    "reached_target", "target_val_loss", "final_val_loss", "steps_to_target", "tokens_to_target", "seconds_to_target",
    "compile_step_seconds", "tokens_per_second", "mfu", "num_params", "devices", "resumed_from_step", "timed_from_step",
)  # fmt: skip
STDLIB_REQUEST = "stdlib_request.json"  # what `stdlib_shards` wrote a folder for


def stdlib_shards(out: str | Path, *, max_files: int = 0, val_fraction: float = 0.05) -> Path:
    """Byte-level ``train_*.bin`` / ``val_*.bin`` shards of the standard library's Python files (the first
    ``max_files`` of them; 0: all; ``val_fraction`` of the documents, by a hash of their text, in ``val``) in
    ``out``, written once and reused by a run that asks for the same (``STDLIB_REQUEST`` beside them).

    Raises:
      cli.UsageError: ``max_files`` is negative, or ``out`` holds shards written for another request.
    """
    if max_files < 0:
        raise cli.UsageError(f"--max_files={max_files} must be >= 0 (0: every file)")
    out, request = Path(out), {"max_files": max_files, "val_fraction": val_fraction}
    if (out / MANIFEST).is_file():
        written = json.loads((out / STDLIB_REQUEST).read_text()) if (out / STDLIB_REQUEST).is_file() else None
        if written != request:
            raise cli.UsageError(
                f"{out} holds shards written for {written or 'another source'}, not this run's stdlib shards {request}; "
                "give another --shards folder or delete that one"
            )
        return out
    files = corpus.list_documents(corpus.stdlib_root(), python_only=True)
    files = files[:max_files] if max_files else files
    # a few stdlib files are Latin-1 / KOI8-R (test/encoded_modules): read as `experiments.tokenize` reads the stdlib
    tokenize("bytes", files, out, val_fraction=val_fraction, shard_tokens=10**8, workers=1, errors="replace")
    (out / STDLIB_REQUEST).write_text(json.dumps(request))
    return out


def run(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    shard_dir: str | Path = "",
    max_files: int = 0,
    val_fraction: float = 0.05,
    interrupt_at: int | None = None,
) -> dict:
    """Trains ``config`` in ``workdir`` until its ``target_val_loss`` (or its ``steps``); returns the report.

    Without ``data.train_files`` the run reads `stdlib_shards` in ``shard_dir`` (default: under the corpus cache).
    A workdir holding an interrupted speedrun resumes it (the report's seconds add those of the earlier processes,
    which the trainer records per checkpoint; ``timed_from_step`` > 0 where that record is missing and only the
    resumed steps are timed); one holding a finished speedrun is left as it is and its report returned.
    ``interrupt_at`` simulates a preemption after that step: the trainer's ``{"interrupted": True, ...}`` is returned.
    """
    if config.get("target_val_loss") is None:
        raise cli.UsageError("the speedrun needs config.target_val_loss (3.28 for the record)")
    if not config.data.train_files:
        folder = stdlib_shards(shard_dir or corpus.default_cache_dir() / "speedrun-stdlib-shards", max_files=max_files, val_fraction=val_fraction)
        config = copy.deepcopy(config)
        config.data.train_files, config.data.val_files = str(folder / "train_*.bin"), str(folder / "val_*.bin")
    summary, path = trainer.run(config, workdir, interrupt_at=interrupt_at), Path(workdir) / "speedrun.json"
    if summary.get("interrupted"):
        return summary
    if summary.get("finished") and path.is_file():
        return json.loads(path.read_text())
    report = {key: summary.get(key) for key in REPORT_KEYS}
    path.write_text(json.dumps(report, indent=2))
    return report


def describe(report: dict) -> str:
    """One line: where the run stopped and what it took."""
    verdict = "reached" if report["reached_target"] else "did not reach"
    line = (
        f"{verdict} val loss {report['target_val_loss']} (last {report['final_val_loss']:.4f}) in {report['steps_to_target']} steps, "
        f"{report['tokens_to_target']:,} tokens, {report['seconds_to_target']:.1f} s of training without compilation "
        f"on {report['devices']} device(s)"
    )
    resumed, timed_from = report.get("resumed_from_step"), report.get("timed_from_step", report.get("resumed_from_step"))
    if timed_from:
        return f"{line} (resumed at step {timed_from}: the seconds are those of steps {timed_from + 1} on)"
    return f"{line} (resumed at step {resumed}; the seconds include the earlier processes' steps)" if resumed else line


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv
    cli.split_cpu_devices()
    cli.quiet_logging(flags.FLAGS.verbose)
    try:
        report = run(config_flag.value, flags.FLAGS.workdir, shard_dir=flags.FLAGS.shards, max_files=flags.FLAGS.max_files)
    except (cli.UsageError, shards.ShardError, ValueError) as e:
        if flags.FLAGS.verbose:
            raise
        cli.usage_exit(str(e))
    except trainer.NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if report.get("interrupted"):  # the trainer said where it stopped and how to resume
        sys.exit(128 + report["signal"])
    print(describe(report))
    print(json.dumps(report))
    sys.exit(0 if report["reached_target"] else 1)


def define_flags() -> flags.FlagHolder:
    cli.define_output_folder_flag("workdir", None, "Output folder (fresh: a finished speedrun is not rerun).", required=True)
    cli.define_output_folder_flag("shards", "", "Folder for the stdlib shards of a run without data.train_files; default: under ~/.cache/spmdlab.")
    flags.DEFINE_integer("max_files", 0, "Stdlib shards from only the first N Python files (0: all).")
    cli.define_verbose_flag()
    cli.define_cpu_devices_flag()
    flags.declare_key_flag("cpu_devices")
    config = cli.define_config_flag("experiments/configs/speedrun.py")
    flags.declare_key_flag("config")
    return config


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=cli.parse_flags)
