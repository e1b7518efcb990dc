"""Where the suite's CPU time goes: ``python -m pytest -p tests.cpu_profile [--cpu_profile=FILE]``.

Each test's outcome, CPU seconds (its process's user + system time over all threads, XLA's compile and
intra-op threads included, plus the processes it started and waited for) and wall seconds are
appended to ``FILE`` (JSON lines, default ``.cpu_profile.jsonl``) by whichever process runs it, so a
pytest-xdist run works and a cut-short run keeps what it measured. Fixture set-up counts for the
test that triggers it (a module fixture for the module's first test). CPU time, unlike wall time,
stays meaningful on a loaded machine. At the end the controller prints the files that cost most.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path

import pytest

_TOP_FILES = 25
_OUTCOME = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu_profile", default=".cpu_profile.jsonl", help="JSON lines of per-test CPU and wall seconds")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a plain run) starts the file afresh
        Path(session.config.getoption("cpu_profile")).write_text("")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed or (report.skipped and item.stash.get(_OUTCOME, "passed") == "passed"):
        item.stash[_OUTCOME] = "failed" if report.failed else "skipped"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _cpu_seconds(), time.time()
    try:
        return (yield)
    finally:
        row = {"test": item.nodeid, "outcome": item.stash.get(_OUTCOME, "passed"), "cpu_s": round(_cpu_seconds() - cpu, 3), "wall_s": round(time.time() - wall, 3), "pid": os.getpid()}
        with open(item.config.getoption("cpu_profile"), "a") as f:
            f.write(json.dumps(row) + "\n")


def per_file(rows: list[dict]) -> list[tuple[str, int, float]]:
    """``(file, tests, cpu seconds)``, the costliest first."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for row in rows:
        entry = totals[row["test"].split("::")[0]]
        entry[0] += 1
        entry[1] += row["cpu_s"]
    return sorted(((f, n, s) for f, (n, s) in totals.items()), key=lambda r: -r[2])


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    path = Path(config.getoption("cpu_profile"))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    if not rows:
        return
    total = sum(r["cpu_s"] for r in rows)
    terminalreporter.section(f"CPU seconds: {total:,.0f} over {len(rows)} tests ({path})")
    for file, n, seconds in per_file(rows)[:_TOP_FILES]:
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {n:4d} tests  {file}")
