r"""Where a training step's device time goes: a jax profiler trace summarised by kernel category
(`experiments.profile_summary` is its command).

    python -m experiments.train --workdir=runs/p --config.profile=5:7   # trace steps 5 to 7
    python -m experiments.profile_summary runs/p [--top=20]

``--config.profile=START:STOP`` (`StepTrace`) traces steps ``START`` through ``STOP`` (the numbering of
``metrics.jsonl``; a run's first step compiles and is left out of the window, with a line that says so) with
`jax.profiler` into ``WORKDIR/plugins/profile/<run>/``: an ``.xplane.pb`` that TensorBoard's profile
plugin and XProf read (``tensorboard --logdir=WORKDIR``), and the same trace as Chrome trace-event JSON
(``*.trace.json.gz``, ``perfetto_trace.json.gz``), which this module reads without any plugin. Only
process 0 traces; into a workdir in object storage (``gs://...``) the trace is written locally and
copied when it stops (jax's profiler writes local files only). Each step carries a
`jax.profiler.StepTraceAnnotation`, so XProf's step view and this summary both know how many steps
the trace holds.

The summary counts *kernels*: on a GPU the events of the device's stream lines (kernels, memcpys),
on the CPU the XLA thunks (events that name their ``hlo_op``). Each falls in one category by its
kernel and HLO op names (`category`): matrix products, attention, copies (copies, transposes,
dynamic-update-slices: buffer moves), collectives, reductions, elementwise (other fusions), other.
``idle`` is the time inside the traced window of each device (first kernel start to last kernel end)
when none of its lines runs a kernel; several CPU threads or GPU streams running at once count once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax

from experiments import storage

CATEGORIES = ("matrix products", "attention", "copies", "collectives", "reductions", "elementwise", "other")

# (category, pattern over "kernel name | hlo op"), first match wins: attention before matrix products
# (cuDNN's fused attention is also a gemm), collectives before reductions (all-reduce).
_RULES = (
    ("attention", r"fmha|flash|attention|_mha|mha_|cudnn\$|splash"),
    ("collectives", r"all-reduce|all-gather|reduce-scatter|collective|all-to-all|nccl|send|recv|psum"),
    ("matrix products", r"gemm|dot|matmul|convolution|cublas|cutlass|nvjet|sm\d+_xmma|ynn_fusion|xnn_fusion|onednn|ragged|gmm|triton_gemm"),
    ("copies", r"copy|memcpy|memset|dynamic-update-slice|dynamic_update_slice|transpose|concatenate"),
    ("reductions", r"reduce|reduction|argmax|argmin|softmax"),
    ("elementwise", r"fusion|loop_|elementwise|convert|multiply|add|subtract|exp|select|broadcast|compare|negate|tanh|rsqrt|divide"),
)


def parse_steps(text: str) -> tuple[int, int] | None:
    """``"START:STOP"`` -> ``(START, STOP)`` (steps numbered from 1, both traced); ``""`` -> None."""
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"profile={text!r} must be START:STOP with 1 <= START <= STOP, e.g. --config.profile=5:7")
    return int(match[1]), int(match[2])


class StepTrace:
    """Traces the steps ``steps = (START, STOP)`` of a training loop into ``workdir`` (None: does nothing).

    The loop calls ``begin(step, state)`` before dispatching step ``step`` and ``end(step, state)`` after;
    the trace starts and stops with the device idle (``state`` ready), so it holds those steps alone.
    ``enabled=False`` (every process but 0 of a job) traces nothing. A run's first step (1, or
    ``resumed_at + 1`` for a run resumed after step ``resumed_at``) compiles, so a window holding it
    traces the steps after it and says which, or that none is left.
    """

    def __init__(self, steps: tuple[int, int] | None, workdir: str | Path, *, enabled: bool = True, resumed_at: int = 0):
        self.steps, self.workdir, self.active = steps if enabled else None, storage.workdir(workdir), False
        self._local: str | None = None  # the local folder of a trace bound for object storage
        if self.steps and resumed_at + 1 >= self.steps[0]:
            (start, stop), first = self.steps, resumed_at + 2
            resumed = f"resumed after step {resumed_at}, and " if resumed_at else ""
            said = f"profile={start}:{stop}: {resumed}step {resumed_at + 1} compiles"
            if first > stop:
                later = f"{first}:{first + stop - start}"
                print(f"{said}: no step of the window is left to trace (give a later one, e.g. --config.profile={later})", file=sys.stderr)
                self.steps = None
            else:
                print(f"{said}: steps {first} to {stop} are traced", file=sys.stderr)
                self.steps = (first, stop)

    def begin(self, step: int, state: Any) -> contextlib.AbstractContextManager:
        """Starts the trace at ``START``; returns the step's annotation (a null context outside the trace)."""
        if self.steps and step == self.steps[0] and not self.active:
            jax.block_until_ready(state)
            self._local = storage.staging_folder(self.workdir, "spmdlab-trace-")
            jax.profiler.start_trace(self._local or str(self.workdir), create_perfetto_trace=True)
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step) if self.active else contextlib.nullcontext()

    def end(self, step: int, state: Any) -> None:
        if self.active and step >= self.steps[1]:
            self.close(state)

    def close(self, state: Any = None) -> None:
        """Stops a running trace (also when the run ends before ``STOP``), copying it into object storage."""
        if self.active:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.active = False
            if self._local:
                storage.publish(self._local, self.workdir)


def trace_file(path: str | Path) -> Path:
    """The newest trace-event JSON under ``path`` (a workdir, a run folder of ``plugins/profile``, or the file)."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("*.trace.json.gz")) or sorted(path.rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {path}; trace steps with --config.profile=START:STOP first")
    return max(found, key=lambda p: (p.parent.name, p.stat().st_mtime))


def load_events(path: str | Path) -> list[dict]:
    """The trace events of `trace_file` ``(path)``."""
    with gzip.open(trace_file(path), "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    hlo_op: str
    device: int  # the process (pid) the kernel ran on
    start: float  # microseconds
    duration: float


def kernels(events: Iterable[dict]) -> list[Kernel]:
    """The device kernels of a trace: GPU/TPU stream events where the trace has devices, else XLA:CPU thunks."""
    events = list(events)
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, name in processes.items() if name.startswith("/device:") and "CPU" not in name}
    out = []
    for e in events:
        if e.get("ph") != "X" or not e.get("dur"):
            continue
        args = e.get("args") or {}
        if devices:  # stream lines; "XLA Ops" / "XLA Modules" / "Steps" are derived from them
            thread = threads.get((e["pid"], e.get("tid")), "")
            if e["pid"] not in devices or not thread.startswith("Stream"):
                continue
        elif "hlo_op" not in args or e["name"].startswith("end: "):
            continue
        out.append(Kernel(e["name"], str(args.get("hlo_op", "")), e["pid"], float(e["ts"]), float(e["dur"])))
    return out


def category(kernel: Kernel) -> str:
    """The category of ``kernel`` from its name and HLO op (`_RULES`, first match)."""
    text = f"{kernel.name} | {kernel.hlo_op}".lower()
    return next((cat for cat, pattern in _RULES if re.search(pattern, text)), "other")


def step_count(events: Iterable[dict]) -> int:
    """Distinct ``step_num`` of the trace's step annotations (0 when it has none)."""
    return len({(e.get("args") or {}).get("step_num") for e in events if e.get("ph") == "X" and "step_num" in (e.get("args") or {})})


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclasses.dataclass(frozen=True)
class Summary:
    steps: int
    by_category: dict[str, tuple[float, int]]  # category -> (microseconds, kernels); "idle" -> (microseconds, 0)
    top: list[tuple[str, str, str, float, int]]  # (name, hlo op, category, microseconds, count), most time first


def summarize(events: list[dict], top: int = 15) -> Summary:
    """Time per category (plus idle) and the ``top`` kernels by total time."""
    ks = kernels(events)
    if not ks:
        raise ValueError("the trace holds no device kernels (was anything run between the trace's start and stop?)")
    by_category: dict[str, list[float]] = {c: [0.0, 0] for c in CATEGORIES}
    per_kernel: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for k in ks:
        entry = by_category[category(k)]
        entry[0] += k.duration
        entry[1] += 1
        per_kernel[k.name, k.hlo_op][0] += k.duration
        per_kernel[k.name, k.hlo_op][1] += 1
    idle = 0.0
    for device in {k.device for k in ks}:
        spans = [(k.start, k.start + k.duration) for k in ks if k.device == device]
        idle += max(e for _, e in spans) - min(s for s, _ in spans) - _busy(spans)
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return Summary(
        steps=step_count(events),
        by_category={**{c: (t, int(n)) for c, (t, n) in by_category.items()}, "idle": (idle, 0)},
        top=[(name, op, category(Kernel(name, op, 0, 0, 0)), t, int(n)) for (name, op), (t, n) in ranked],
    )


def format_summary(summary: Summary) -> str:
    """The category table and the top-kernel table, in milliseconds per step."""
    per = max(summary.steps, 1)
    total = sum(t for t, _ in summary.by_category.values())
    lines = [f"{summary.steps or 'unannotated'} traced step(s); ms per step", "", f"{'category':<16} {'ms':>9} {'share':>7} {'kernels':>8}"]
    for name, (t, n) in sorted(summary.by_category.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"{name:<16} {t / 1e3 / per:9.3f} {100 * t / total:6.1f}% {n / per:8.0f}")
    lines += ["", f"{'ms':>9} {'calls':>6}  {'category':<16} kernel / HLO op"]
    for name, op, cat, t, n in summary.top:
        label = name if not op or op == name else f"{name} / {op}"
        lines.append(f"{t / 1e3 / per:9.3f} {n / per:6.0f}  {cat:<16} {label}")
    return "\n".join(lines)
