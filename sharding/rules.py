"""Logical-to-mesh axis rules: how the model's named dimensions map onto the device mesh.

Models name every parameter and key activation dimension with a *logical* axis (``batch``, ``seq``,
``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``experts``, ``layers``, and
``latent``, the compressed width of multi-head latent attention, replicated in every preset). A
rule set maps each logical name to zero, one or several mesh axes. Mesh axes that the current mesh
lacks are dropped, so one rule set serves every mesh: ``fsdp`` rules on a ``data:8`` mesh are plain
data parallelism.

Presets (mesh axis names ``data``, ``fsdp``, ``tensor``, ``seq``, ``expert``):

- ``dp``: batch over ``data``; parameters replicated.
- ``fsdp`` (default): batch over ``data`` and ``fsdp``; parameters, gradients and optimizer state
  sharded along ``embed`` over ``fsdp`` (ZeRO-3), gathered per layer by GSPMD. With no ``fsdp``
  axis in the mesh this is plain data parallelism.
- ``tp``: Megatron tensor parallelism: ``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` over ``tensor``,
  one all-reduce after attention and one after the MLP; combined with FSDP on ``embed``.
- ``sp``: the ``tp`` rules plus activations sharded along ``seq`` over ``seq`` (context parallelism).

``expert`` parallelism maps ``experts`` onto the ``expert`` axis in every preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import jax

MeshAxes = tuple[str, ...]
RuleTable = tuple[tuple[str, MeshAxes], ...]

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "experts", "layers", "latent")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Two tables: one for parameters (and everything shaped like them), one for activations.

    They differ where a mesh axis plays two roles: under FSDP the ``fsdp`` axis shards parameters
    along ``embed`` but activations along ``batch``, so ``embed`` maps to ``fsdp`` only for
    parameters.
    """

    params: RuleTable
    activations: RuleTable


_BATCH = ("data", "fsdp", "expert")
_TENSOR = {"heads": ("tensor",), "kv_heads": ("tensor",), "mlp": ("tensor",), "vocab": ("tensor",)}

PRESETS: dict[str, dict[str, dict[str, MeshAxes]]] = {
    "dp": {"params": {"experts": ("expert",)}, "activations": {"batch": _BATCH, "experts": ("expert",)}},
    "fsdp": {
        "params": {"embed": ("fsdp",), "experts": ("expert",)},
        "activations": {"batch": _BATCH, "experts": ("expert",)},
    },
    "tp": {
        "params": {"embed": ("fsdp",), **_TENSOR, "experts": ("expert",)},
        "activations": {"batch": _BATCH, **_TENSOR, "experts": ("expert",)},
    },
}
PRESETS["sp"] = {
    "params": PRESETS["tp"]["params"],
    "activations": {**PRESETS["tp"]["activations"], "seq": ("seq",)},
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
) -> jax.P:
    """Maps one array's logical axis names to a `PartitionSpec` on a mesh with ``mesh_axis_names``.

    Mesh axes missing from the mesh (or of which the mesh has only the name) are dropped. Mapping two
    dimensions of one array onto the same mesh axis is an error, never a silent drop.
    """
    if logical is None:
        return jax.P()
    table = dict(rules)
    present = set(mesh_axis_names)
    spec, used = [], {}
    for dim, name in enumerate(logical):
        axes = tuple(a for a in table.get(name, ()) if a in present) if name is not None else ()
        for axis in axes:
            if axis in used:
                raise ValueError(
                    f"rules map dimensions {used[axis]} ({logical[used[axis]]!r}) and {dim} ({name!r}) of an array "
                    f"with logical axes {tuple(logical)} onto the same mesh axis {axis!r}; override one rule"
                )
            used[axis] = dim
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return jax.P(*spec)
