"""Logical-to-mesh axis rules: how the model's named dimensions map onto the device mesh.

Models name every parameter and key activation dimension with a *logical* axis (``batch``, ``seq``,
``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``experts``, ``layers``, and
``latent``, the compressed width of multi-head latent attention, and ``streams``, ParScale's
per-stream parameters, both replicated in every preset). A
rule set maps each logical name to zero, one or several mesh axes. Mesh axes that the current mesh
lacks are dropped, so one rule set serves every mesh: ``fsdp`` rules on a ``data:8`` mesh are plain
data parallelism.

Presets (mesh axis names ``data``, ``fsdp``, ``tensor``, ``seq``, ``expert``, ``context``, ``stage``: `sharding.axes`):

- ``dp``: batch over ``data``; parameters replicated.
- ``fsdp`` (default): batch over ``data``, ``fsdp`` and ``expert``; parameters, gradients and optimizer
  state sharded along ``embed`` over ``fsdp`` (ZeRO-3), gathered per layer by GSPMD. With no ``fsdp``
  axis in the mesh this is plain data parallelism.
- ``tp``: Megatron tensor parallelism: ``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` over ``tensor``,
  one all-reduce after attention and one after the MLP; combined with FSDP on ``embed``.
- ``sp``: the ``tp`` rules plus activations sharded along ``seq`` over ``seq`` (context parallelism).

Context parallelism splits activations along ``seq`` over the ``context`` axis in every preset;
attention then runs as explicit `jax.shard_map` code (`lm.parallel.context_attention`: all-gather, ring or
Ulysses, ``--config.model.context_parallel``) instead of GSPMD's propagation.

``expert`` parallelism maps ``experts`` onto the ``expert`` axis in every preset. The ``expert`` axis
is a data-parallel axis for everything but the routed experts, so the sharded presets also split
``embed`` over it where it is free: dense weights, norms and embeddings are split over ``fsdp`` x
``expert`` (ZeRO-3 over every data-parallel axis but ``data``, as MaxText's rules do), an expert stack
``(experts, embed, mlp)`` over ``expert`` on its first axis and ``fsdp`` on ``embed``. ``latent`` (the
rank of multi-head latent attention's down- and up-projections) takes ``fsdp`` and ``expert`` where
free too, so MLA's up-projections ``(latent, heads)`` are split under FSDP while the down-projections
``(embed, latent)`` are split on ``embed``.

Pipeline parallelism maps the scanned block stack's ``layers`` axis of every parameter (and so of its
gradient and optimizer state) onto the ``stage`` axis in every preset: stage ``s`` holds the ``s``-th
contiguous group of layers of the same ``[L, ...]`` arrays that every other mesh stores
(`lm.parallel.pipeline`). Activations never take ``stage``.

Optional mesh axes: a mesh axis written with a trailing ``?`` (``embed: ("fsdp", "expert?")``, or
``--config.rule_overrides=embed=fsdp+expert?``) is taken by a dimension only where no other dimension
of the same array takes it (required axes first, then optional ones in dimension order) and, when
the array's shape is known, only where it keeps the dimension evenly split. A required axis claimed
by two dimensions stays an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np

from sharding import axes as mesh_axes

MeshAxes = tuple[str, ...]
RuleTable = tuple[tuple[str, MeshAxes], ...]

OPTIONAL = "?"  # a mesh axis written "expert?" is optional (`logical_to_mesh_spec`)

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "experts", "layers", "latent", "streams")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Two tables: one for parameters (and everything shaped like them), one for activations.

    They differ where a mesh axis plays two roles: under FSDP the ``fsdp`` axis shards parameters
    along ``embed`` but activations along ``batch``, so ``embed`` maps to ``fsdp`` only for
    parameters.
    """

    params: RuleTable
    activations: RuleTable


_BATCH = (mesh_axes.DATA, mesh_axes.FSDP, mesh_axes.EXPERT)
_TENSOR = {"heads": (mesh_axes.TENSOR,), "kv_heads": (mesh_axes.TENSOR,), "mlp": (mesh_axes.TENSOR,), "vocab": (mesh_axes.TENSOR,)}
# ZeRO-3 parameter splitting: `embed` over fsdp, and over expert where the routed-expert axis leaves it free.
_ZERO3 = {"embed": (mesh_axes.FSDP, mesh_axes.EXPERT + OPTIONAL), "latent": (mesh_axes.FSDP + OPTIONAL, mesh_axes.EXPERT + OPTIONAL), "experts": (mesh_axes.EXPERT,)}

_CONTEXT = {"seq": (mesh_axes.CONTEXT,)}
# Pipeline parallelism: the scanned block stack's layers split over `stage` (contiguous groups per stage).
_STAGE = {"layers": (mesh_axes.STAGE,)}

PRESETS: dict[str, dict[str, dict[str, MeshAxes]]] = {
    "dp": {"params": {"experts": (mesh_axes.EXPERT,), **_STAGE}, "activations": {"batch": _BATCH, "experts": (mesh_axes.EXPERT,), **_CONTEXT}},
    "fsdp": {
        "params": {**_ZERO3, **_STAGE},
        "activations": {"batch": _BATCH, "experts": (mesh_axes.EXPERT,), **_CONTEXT},
    },
    "tp": {
        "params": {**_ZERO3, **_TENSOR, **_STAGE},
        "activations": {"batch": _BATCH, **_TENSOR, "experts": (mesh_axes.EXPERT,), **_CONTEXT},
    },
}
PRESETS["sp"] = {
    "params": PRESETS["tp"]["params"],
    "activations": {**PRESETS["tp"]["activations"], "seq": (mesh_axes.SEQ, mesh_axes.CONTEXT)},
}


def _as_axes(value: str | Sequence[str] | None) -> MeshAxes:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return tuple(a for a in value.split("+") if a)
    return tuple(value)


def make_rules(preset: str = "fsdp", overrides: Mapping[str, str | Sequence[str] | None] | None = None) -> Rules:
    """The rule set ``preset`` with single rules replaced by ``overrides``.

    An override maps a logical name to mesh axes in both tables: ``{"mlp": "tensor"}``,
    ``{"batch": "data+fsdp"}``, or ``{"embed": None}`` to replicate. Prefix the name with
    ``params.`` or ``activations.`` to change one table only. From config: ``--config.rules=tp``
    and ``--config.rule_overrides="mlp=tensor,params.vocab="``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown rule preset {preset!r}; set --config.rules to one of {', '.join(PRESETS)}")
    tables = {kind: dict(table) for kind, table in PRESETS[preset].items()}
    for key, value in (overrides or {}).items():
        kind, _, name = key.rpartition(".")
        if kind not in ("", "params", "activations"):
            raise ValueError(f"rule override {key!r}: the prefix must be 'params.' or 'activations.'")
        if name not in LOGICAL_AXES:
            raise ValueError(f"rule override for unknown logical axis {name!r}; logical axes: {', '.join(LOGICAL_AXES)}")
        for target in ("params", "activations") if not kind else (kind,):
            tables[target][name] = _as_axes(value)
    return Rules(**{kind: tuple((n, _as_axes(a)) for n, a in table.items()) for kind, table in tables.items()})


def parse_overrides(text: str) -> dict[str, str]:
    """``"mlp=tensor,params.vocab="`` -> ``{"mlp": "tensor", "params.vocab": ""}``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"rule override {part!r} is not of the form logical=mesh_axis[+mesh_axis]")
        out[name.strip()] = value.strip()
    return out



def logical_to_mesh_spec(
    logical: Sequence[str | None] | None,
    rules: RuleTable,
    mesh_axis_names: Iterable[str],
    *,
    shape: Sequence[int] | None = None,
    axis_sizes: Mapping[str, int] | None = None,
) -> jax.P:
    """Maps one array's logical axis names to a `PartitionSpec` on a mesh with ``mesh_axis_names``.

    Mesh axes missing from the mesh are dropped. Mapping two dimensions of one array onto the same
    required mesh axis is an error, never a silent drop. Optional axes (``"expert?"``) go, in
    dimension order, to the dimensions whose rule names them where the mesh axis is still free and,
    given the array's ``shape`` and the mesh's ``axis_sizes``, where the dimension still splits evenly.
    """
    if logical is None:
        return jax.P()
    table = dict(rules)
    present = set(mesh_axis_names)
    rule = [table.get(name, ()) if name is not None else () for name in logical]
    spec, used = [], {}
    for dim, name in enumerate(logical):
        axes = tuple(a for a in rule[dim] if not a.endswith(OPTIONAL) and a in present)
        for axis in axes:
            if axis in used:
                raise ValueError(
                    f"rules map dimensions {used[axis]} ({logical[used[axis]]!r}) and {dim} ({name!r}) of an array "
                    f"with logical axes {tuple(logical)} onto the same mesh axis {axis!r}; override one rule"
                )
            used[axis] = dim
        spec.append(list(axes))
    for dim, axes in enumerate(spec):
        for axis in (a.removesuffix(OPTIONAL) for a in rule[dim] if a.endswith(OPTIONAL)):
            if axis not in present or axis in used:
                continue
            if shape is not None and axis_sizes is not None:
                ways = int(np.prod([axis_sizes[a] for a in (*axes, axis)]))
                if shape[dim] % ways:
                    continue
            axes.append(axis)
            used[axis] = dim
    return jax.P(*(axes[0] if len(axes) == 1 else (tuple(axes) or None) for axes in spec))
