"""The command lines of the README, docs/benchmarks.md and each script's docstring parse with the flags and config keys of the
scripts they call: a renamed flag or key would otherwise leave them telling users to type a command that fails."""

import ast
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import command_lines  # noqa: E402


def _markdown_calls(name: str) -> list[tuple[str, list[str]]]:
    """The ``python -m experiments.<module>`` calls of the code blocks of markdown file ``name`` (continuations
    joined, comments off); a line with a placeholder (``<name>``, ``$P``) is a template, not a command."""
    text = (command_lines.REPO / name).read_text()
    calls = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m experiments." in line and not re.search(r"<[a-z_|]+>|\$", line):
                calls += command_lines.module_calls(shlex.split(line, comments=True))
    return calls


def _docstring_calls() -> list[tuple[str, list[str]]]:
    """The ``python -m experiments.<module>`` calls of the docstrings of ``experiments/*.py``."""
    calls = []
    for path in sorted((command_lines.REPO / "experiments").glob("*.py")):
        if path.stem == "check_imports":  # no flags: a plain script
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        for line in docstring.replace("\\\n", " ").splitlines():
            if "python -m experiments." in line:
                calls += command_lines.module_calls(shlex.split(line, comments=True))
    return calls


def test_every_readme_and_docstring_command_parses_with_its_scripts_flags():
    calls, benchmarks = _markdown_calls("README.md"), _markdown_calls("docs/benchmarks.md")
    modules = {module for module, _ in calls}
    assert len(calls) >= 30 and {"experiments.train", "experiments.speedrun", "experiments.export_hf", "experiments.evaluate"} <= modules
    assert len(benchmarks) >= 40  # the commands that measured docs/benchmarks.md's figures, rerun as written
    docstrings = _docstring_calls()
    assert len({module for module, _ in docstrings}) >= 20
    misspelt = [("experiments.train", ["--config.model.n_layer=2"]), ("experiments.sample", ["--workdir=x", "--temp=1"])]
    refused = command_lines.refusals(calls + benchmarks + docstrings + misspelt)  # the last two show that the check can refuse
    assert [(module, args) for module, args, _ in refused] == misspelt, refused
