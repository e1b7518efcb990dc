r"""Prints where a traced training step's device time goes, by kernel category (`experiments.profiling`).

    python -m experiments.train --workdir=runs/p --config.profile=5:7   # trace steps 5 to 7
    python -m experiments.profile_summary runs/p [--top=20]
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import cli
from experiments.profiling import format_summary, load_events, summarize


def define_flags() -> None:
    flags.DEFINE_integer("top", 15, "kernels listed by total time")


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise app.UsageError("give one WORKDIR (or trace file): python -m experiments.profile_summary WORKDIR [--top=N]", exitcode=2)
    try:
        print(format_summary(summarize(load_events(argv[1]), flags.FLAGS.top)))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags_and_one_argument)


