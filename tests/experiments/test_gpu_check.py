"""experiments/gpu_check.sh: the one-call GPU check, run against a stand-in ``python3`` that records its calls
(each benchmark has its own tests; the script's header gives the CPU-sized smoke run)."""

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import command_lines  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_check.sh"
WHEELS_LINE = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl "
    "&& export PYTHONPATH=/tmp/site:$PWD || exit;"
)
PRIORITY = [
    "step_gpt2-124m_auto", "torch_twin", "profile_gpt2-124m", "profile_moe-small", "profile_muon", "step_gpt2-124m_unrolled",
    "step_gpt2-124m_unroll2", "step_gpt2-124m_double_buffer", "step_gpt2-124m_fp8", "speedrun", "optimizers", "step_moe-small",
    "step_llama-1b", "step_gpt2-124m_pallas", "kernels", "step_llama-1b_fp8", "optimizer_updates",
]  # fmt: skip
# Records each call; runs `python3 -c` (results.jsonl lines) with the real Python; sleeps as long as $SLEEP_TESTS
# says in the tests' command only (a match on any "pytest" slept in every row: their paths are under pytest's
# tmp_path); fails the pallas row; writes the JSON a benchmark was asked for.
FAKE_PYTHON = f"""#!/bin/bash
if [ "$1" = -c ]; then exec {sys.executable} "$@"; fi
echo "$(date +%s) PYTHONPATH=${{PYTHONPATH:-}} $*" >> "$CALLS"
case "$*" in "-m pytest "*) sleep "${{SLEEP_TESTS:-0}}" ;; *main_job*) sleep 1 ;; esac
case "$*" in *attention=pallas*) exit 1 ;; esac
for arg in "$@"; do case "$arg" in --json_out=*|--out=*) echo '{{"ok": 1}}' > "${{arg#*=}}" ;; esac; done
"""


def _run(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {"OUT": str(out), "WORK": str(tmp_path / "work"), "PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls.txt"), **env}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    return result, out


def test_the_script_starts_with_the_gpu_wheels_line():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0
    tool = Path("/work/shared/tools/gpu-wheels")
    printed = tool.read_text().strip().splitlines()[-2] if tool.is_file() else WHEELS_LINE
    assert printed == WHEELS_LINE
    assert WHEELS_LINE in SCRIPT.read_text()


def test_dry_run_lists_the_steps_by_priority_within_eight_minutes(tmp_path):
    result, _ = _run(tmp_path, DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("tests (background, timeout 240): env SPMDLAB_TEST_PLATFORMS=cuda,cpu SPMDLAB_TEST_CPU_DEVICES=1")
    assert " -v " in lines[0]  # each outcome as it comes: a run cut by its timeout still names its failures
    assert lines[1].startswith("main_job (timeout 120): env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m experiments.train")
    assert [line.split(":")[0] for line in lines[2:]] == PRIORITY
    assert "--config.model.attention=auto" in lines[2] and "--tokens=zipf" in lines[2]
    assert "experiments.bench_cpu_peer --device=cuda --presets=gpt2-124m --batch_shapes=16x1024" in lines[3]
    assert "--xla_gpu_enable_command_buffer=" in lines[4] and "--config.optimizer.name=muon" in lines[6]
    expected = [int(re.search(r": expected (\d+) s", line).group(1)) for line in lines[2:]]
    assert 240 + sum(expected[:3]) <= 470  # the tests, then the step row, the twin and the profile fit in the budget


def test_one_run_writes_at_most_8_files_tests_beside_the_main_job_and_skips_past_the_budget(tmp_path):
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "ml_collections-1.0-py3-none-any.whl").write_text("")
    result, out = _run(tmp_path, BUDGET_S="80", SLEEP_TESTS="2")
    assert result.returncode == 0, result.stderr
    calls = [c.split(" ", 1) for c in (tmp_path / "calls.txt").read_text().splitlines()]
    commands = [c for _, c in calls]
    assert commands[0].startswith("PYTHONPATH= -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/")
    assert all(c.startswith(f"PYTHONPATH=/tmp/site:{tmp_path} ") for c in commands[1:])
    tests, main = next(c for c in calls if "pytest" in c[1]), next(c for c in calls if "experiments.train" in c[1])
    assert int(main[0]) - int(tests[0]) < 2  # started together: the tests run while the main job does
    steps = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == ["main_job", "tests", *PRIORITY]
    by_name = {s["step"]: s for s in steps}
    assert by_name["step_gpt2-124m_auto"]["exit"] == 0 and by_name["step_gpt2-124m_auto"]["result"] == {"ok": 1}
    skipped = {s["step"]: s["exit"] for s in steps if str(s["exit"]).startswith("skipped: budget")}
    assert {"torch_twin", "optimizers"} <= set(skipped)  # 110 s and 90 s expected, never 80 s left
    for name, reason in skipped.items():  # skipped only where its expected time passed what was left
        left, expected = map(int, re.search(r"\((\d+) s left, expected (\d+) s\)", reason).groups())
        assert left < expected, (name, reason)
    ran = [s for s in steps[2:] if s["step"] not in skipped]
    assert "profile_gpt2-124m" in {s["step"] for s in ran}  # third in line: 45 s expected, about 75 s left
    assert all(s["exit"] == (1 if s["step"] == "step_gpt2-124m_pallas" else 0) for s in ran)  # a failing row loses nothing else
    assert len(os.listdir(out)) <= 8 and all((out / f).is_file() for f in os.listdir(out))
    profiles = [f"{s['step']}.txt" for s in ran if s["step"].startswith("profile_")]
    assert sorted(os.listdir(out)) == sorted(["env.txt", "log.txt", *profiles, "results.jsonl", "tests.txt"])



def _module_commands(line: str) -> list[tuple[str, list[str]]]:
    """The ``python3 -m experiments.<module> ARGS`` calls of one dry-run line (inside ``bash -c`` too)."""
    tokens = shlex.split(re.split(r"timeout \d+\)?:? ", line, maxsplit=1)[1])
    return command_lines.module_calls(shlex.split(tokens[2]) if tokens[:2] == ["bash", "-c"] else tokens)


def test_every_command_parses_with_its_scripts_flags_and_config_keys(tmp_path):
    """A renamed flag or config key fails here, not in the first minutes of a GPU window."""
    result, _ = _run(tmp_path, DRY_RUN="1")
    assert result.returncode == 0, result.stderr
    commands = [call for line in result.stdout.splitlines() for call in _module_commands(line)]
    modules = {module for module, _ in commands}
    assert {"experiments.train", "experiments.bench_throughput", "experiments.bench_optimizer_step", "experiments.speedrun",
            "experiments.profile_summary", "experiments.bench_kernels", "experiments.bench_cpu_peer"} <= modules  # fmt: skip
    commands.append(("experiments.bench_optimizer_step", ["--optimizers=adamw", "--out=x.json"]))  # the check can refuse
    refused = command_lines.refusals(commands, cwd=SCRIPT.parents[1])
    assert [(module, args) for module, args, _ in refused] == [commands[-1]], refused
    assert "Unknown command line flag 'out'" in refused[0][2]
