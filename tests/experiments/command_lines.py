"""Command lines checked against the scripts they call: every ``python -m experiments.<module> ARGS`` is parsed by
that module's own flags (its ``define_flags``, then absl's parser, which also applies the ``--config.<key>``
overrides to the config file), all in one subprocess, so a renamed flag or config key fails on the host
instead of in a user's terminal or a GPU window."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Prints the refusals as JSON; each module's flags are removed before the next one defines its own.
_PARSE_WITH_MODULE_FLAGS = """
import contextlib, importlib, io, json, sys
from absl import flags
refusals = []
for module_name, args in json.load(sys.stdin):
    module, before, stderr = importlib.import_module(module_name), set(flags.FLAGS), io.StringIO()
    sys.argv = [module_name, *args]
    try:
        with contextlib.redirect_stderr(stderr):
            module.define_flags()
            flags.FLAGS(sys.argv)
    except (SystemExit, Exception) as e:
        refusals.append([module_name, args, f"{type(e).__name__}: {e} {stderr.getvalue()}"])
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
print(json.dumps(refusals))
"""
_ENDS = ("&&", ";", "|", ">", "2>", "&")


def module_calls(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """The ``python[3] -m experiments.<module> ARGS`` calls among shell ``tokens`` (``shlex.split``)."""
    calls = []
    for i, token in enumerate(tokens[:-2]):
        if token in ("python", "python3") and tokens[i + 1] == "-m" and tokens[i + 2].startswith("experiments."):
            calls.append((tokens[i + 2], list(itertools.takewhile(lambda t: t not in _ENDS, tokens[i + 3 :]))))
    return calls


def refusals(calls: list[tuple[str, list[str]]], cwd: Path = REPO) -> list[tuple[str, list[str], str]]:
    """``(module, args, why)`` of each call its module's flags refuse (run from ``cwd``, as a user would)."""
    parsed = subprocess.run(
        [sys.executable, "-c", _PARSE_WITH_MODULE_FLAGS], input=json.dumps(calls), capture_output=True, text=True,
        cwd=cwd, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}, timeout=300,
    )  # fmt: skip
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    return [tuple(r) for r in json.loads(parsed.stdout.splitlines()[-1])]
