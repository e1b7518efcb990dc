r"""Collectives of a compiled XLA program and their bytes on the wire, read from its optimised HLO text
(and, by `loop_buffer_moves`, the activation-sized copies and stack writes inside its while loops).

Every collective (all-reduce, all-gather, all-to-all, reduce-scatter, collective-permute; async
``-start`` forms included) is counted from its result shape:

- **payload**: the bytes ``S`` of the buffer one device holds for the collective, the larger of its
  input and its output (NCCL's convention for message sizes): all-reduce / all-to-all /
  collective-permute: the buffer; all-gather: the gathered result; reduce-scatter: the whole input.
  So one all-gather of a tensor and one all-to-all that reshards it count the same ``S``: its bytes
  per device after the gather, its bytes per device before and after the all-to-all.
- **ring**: the bytes one device sends under the usual ring algorithms, from ``S`` and the group size
  ``n``: all-reduce ``2 (n-1)/n S``, all-gather, reduce-scatter and all-to-all ``(n-1)/n S`` (an
  all-to-all keeps ``1/n`` of its buffer, an all-gather already holds ``1/n`` of its result),
  collective-permute ``S``. This is a model of the algorithm, not a measurement; NCCL's "bus
  bandwidth" factors are the same.

A collective inside a ``while`` body counts once per iteration (XLA's known trip count; an unknown
count is an error). One inside a ``conditional`` branch (DiLoCo's synchronisation, a Streaming
DiLoCo fragment, NoLoCo's pairing of the round) runs on some steps only: the table gives its bytes
per synchronisation, and the amortised per-step figure adds them once every ``H`` steps (each such
branch of these methods runs once per ``H`` steps), or once every ``K`` steps where the collective
sits under a ``sync_period_K`` named scope (`optim.cross_replica.sync_period`: DES-LOC's parameter
and moment periods). Of a conditional's branches one runs, so the largest counts (NoLoCo's ``switch``
has one branch per pairing). Per token divides by the tokens of one step (all replicas).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from experiments import run_spec, train_lib
from sharding import partition

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    payload: int  # bytes of one device's buffer, the larger of input and output
    group: int  # devices taking part
    count: int  # executions per step (while trip counts)
    conditional: bool  # inside a conditional branch
    period: int | None = None  # steps between executions, from a ``sync_period_K`` scope (None: the row's H)

    @property
    def ring(self) -> float:
        n, s = self.group, self.payload
        return {"all-reduce": 2 * (n - 1) / n * s, "collective-permute": s}.get(self.kind, (n - 1) / n * s)


def _shape_bytes(text: str) -> int:
    """Bytes of every array type in ``text`` (a shape or a tuple of shapes)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype in _BYTES:
            total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def group_size(line: str, devices: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:  # replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
        sizes = {k.strip("'"): int(v) for k, v in re.findall(r"('[^']+')=(\d+)", m.group(1))}
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:  # iota form [groups, size]<=[...]
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=\{(.*?)\}\s*[,}]", line)
    return devices if m is None else 2


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Instruction lines per computation name, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def collectives(hlo: str, devices: int) -> list[Collective]:
    """Every collective of an optimised HLO module, with how often and where it runs (of a
    conditional's branches, the one with the most payload)."""
    comps, entry = _computations(hlo)

    def visit(name: str, count: int, conditional: bool, seen: tuple[str, ...], found: list[Collective]) -> None:
        for line in comps.get(name, ()):
            op = re.search(r"=\s*(.*?)\s+([\w\-]+)\(", line)
            kind = op.group(2).removesuffix("-start") if op else ""
            if kind in KINDS and not (op and op.group(2).endswith("-done")):
                result = _shape_bytes(op.group(1))
                n = group_size(line, devices)
                if op.group(2).endswith("-start"):  # async result tuples hold input and output buffers
                    result = result * n // (n + 1) if kind == "all-gather" else result // 2
                payload = result * n if kind == "reduce-scatter" else result
                period = re.search(r'op_name="[^"]*sync_period_(\d+)', line)
                found.append(Collective(kind, payload, n, count, conditional, period and int(period.group(1))))
            if op and op.group(2) == "while":
                trip = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
                body = re.search(r"body=%?([\w.\-]+)", line)
                if trip is None:
                    raise ValueError(f"a while loop without a known trip count: {line.strip()[:120]}")
                if body and body.group(1) not in seen:
                    visit(body.group(1), count * int(trip.group(1)), conditional, (*seen, body.group(1)), found)
            elif op and op.group(2) == "conditional":
                branches = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", line)
                listed = re.search(r"branch_computations=\{([^}]*)\}", line)
                branches += [b.strip().lstrip("%") for b in listed.group(1).split(",")] if listed else []
                taken: list[list[Collective]] = [[]]
                for b in branches:
                    if b not in seen:
                        taken.append([])
                        visit(b, count, True, (*seen, b), taken[-1])
                found += max(taken, key=lambda ops: sum(c.payload * c.count for c in ops))
            else:
                for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                    if callee not in seen:
                        visit(callee, count, conditional, (*seen, callee), found)

    found: list[Collective] = []
    visit(entry, 1, False, (entry,), found)
    return found


def summarize(found: list[Collective], sync_every: int, tokens_per_step: int) -> dict[str, Any]:
    """Bytes per step (every step / per synchronisation / amortised) and per token, payload and ring."""
    out: dict[str, Any] = {"ops": {}}
    for measure in ("payload", "ring"):
        always = sum(getattr(c, measure) * c.count for c in found if not c.conditional)
        per_sync = sum(getattr(c, measure) * c.count for c in found if c.conditional)
        amortised = always + sum(getattr(c, measure) * c.count / (c.period or sync_every) for c in found if c.conditional)
        out[measure] = {"every_step": always, "per_sync": per_sync, "per_step": amortised, "per_token": amortised / tokens_per_step}
    for c in found:
        out["ops"][c.kind] = out["ops"].get(c.kind, 0) + c.count
    return out


def compiled_hlo(config: ml_collections.ConfigDict) -> str:
    """The optimised HLO text of ``config``'s training step (compiled, not run)."""
    spec = run_spec.build_run(config)
    shardings = spec.shardings
    step_fn = train_lib.make_train_step(spec.model_def, spec.tx, replica_axis=shardings.replica_axis)
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.abstract_state(spec.model_def, spec.tx, shardings)
        batch = jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len + 1), jnp.int32, sharding=shardings.batch)
        return train_lib.jit_train_step(step_fn, shardings).lower(state, batch).compile().as_text()


def loop_buffer_moves(hlo: str, activation: tuple[int, int]) -> list[dict[str, int]]:
    """Per while loop of a compiled module (e.g. the scanned layers, forward and backward), how many
    activation-sized buffers its body copies and writes into stacks.

    ``activation = (batch, seq)``: an array counts when its shape holds both in that order
    (``(..., batch, ..., seq, ...)``) or their product (a flattened ``(batch * seq, features)``). ``copies`` are ``copy`` instructions and
    fusions whose root is a copy or transpose (a layout change); ``stack_writes`` are
    dynamic-update-slices (or fusions rooted in one) into a buffer with one more leading axis: the
    saved residuals a rolled scan writes per layer. Each entry: ``{"copies", "stack_writes", "bytes"}``
    (bytes copied and written per iteration).
    """
    comps, _ = _computations(hlo)
    b, t = activation

    def sized(shape: str) -> bool:
        dims = [int(d) for d in re.findall(r"\[([\d,]+)\]", shape)[0].split(",")] if re.search(r"\[[\d,]+\]", shape) else []
        return (b in dims and t in dims[dims.index(b) + 1 :]) or b * t in dims

    def root(name: str) -> str:
        lines = [x for x in comps.get(name, ()) if "ROOT" in x]
        op = re.search(r"=\s*.*?\s+([\w\-]+)\(", lines[0]) if lines else None
        return op.group(1) if op else ""

    out = []
    for lines in comps.values():
        for line in lines:
            body = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if not body:
                continue
            counts = {"copies": 0, "stack_writes": 0, "bytes": 0}
            for inner in comps.get(body.group(1), ()):
                op = re.search(r"=\s*(.*?)\s+([\w\-]+)\(", inner)
                if not op or not sized(op.group(1)):
                    continue
                kind = op.group(2)
                if kind == "fusion":
                    calls = re.search(r"calls=%?([\w.\-]+)", inner)
                    kind = root(calls.group(1)) if calls else kind
                if kind in ("copy", "transpose"):
                    counts["copies"] += 1
                elif kind == "dynamic-update-slice":
                    counts["stack_writes"] += 1
                else:
                    continue
                counts["bytes"] += _shape_bytes(op.group(1))
            out.append(counts)
    return out
