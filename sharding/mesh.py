"""Device meshes from a one-line spec such as ``"data:2,fsdp:2,tensor:2"``.

One size may be ``-1``: it takes whatever the other sizes leave of the device count. Axes whose name
starts with ``dcn_`` span slices (the data-centre network between TPU slices or GPU hosts); they
are combined with the in-slice axis of the same name by `jax.experimental.mesh_utils
.create_hybrid_device_mesh`, so ``"dcn_data:2,data:4,fsdp:8"`` is a 2-slice mesh whose ``data``
axis is 8 long, outermost over the slices.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils

from sharding import axes as mesh_axes

DEFAULT_AXES = (mesh_axes.DATA,)
DCN_PREFIX = "dcn_"


def parse_mesh_spec(spec: str) -> list[tuple[str, int]]:
    """``"data:2,fsdp:-1"`` -> ``[("data", 2), ("fsdp", -1)]``, with checks on names and sizes."""
    if not spec.strip():
        return [(mesh_axes.DATA, -1)]
    axes = []
    for part in spec.split(","):
        name, sep, size = part.strip().partition(":")
        if not sep or not name.isidentifier():
            raise ValueError(f"mesh axis {part.strip()!r} is not of the form name:size, e.g. --config.mesh=data:2,fsdp:4")
        try:
            n = int(size)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} has size {size!r}; give an integer or -1") from None
        if n == 0 or n < -1:
            raise ValueError(f"mesh axis {name!r} has size {n}; sizes are positive, or -1 for 'the rest'")
        axes.append((name, n))
    names = [n for n, _ in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"mesh spec {spec!r} names an axis twice")
    if sum(1 for _, n in axes if n == -1) > 1:
        raise ValueError(f"mesh spec {spec!r} has more than one -1; at most one axis can take 'the rest'")
    return axes


def _divisor_hint(n_devices: int) -> str:
    divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
    return f"sizes must multiply to {n_devices}; divisors of {n_devices}: {divisors}"


def resolve_sizes(axes: list[tuple[str, int]], n_devices: int) -> list[tuple[str, int]]:
    """Fills in the ``-1`` and checks that the sizes multiply to ``n_devices``."""
    known = math.prod(n for _, n in axes if n != -1)
    if any(n == -1 for _, n in axes):
        if n_devices % known:
            raise ValueError(f"mesh sizes {dict(axes)} cannot fill {n_devices} devices: {_divisor_hint(n_devices)}")
        axes = [(name, n_devices // known if n == -1 else n) for name, n in axes]
    total = math.prod(n for _, n in axes)
    if total != n_devices:
        raise ValueError(f"mesh {dict(axes)} has {total} devices but {n_devices} are present: {_divisor_hint(n_devices)}")
    return axes


def _cpu_split_hint(axes: list[tuple[str, int]], devices: list[jax.Device]) -> str:
    """How to run a mesh larger than the host on a CPU: split it into that many devices (`sharding.cpu_devices`)."""
    needed = math.prod(n for _, n in axes if n != -1)
    if not devices or devices[0].platform != "cpu" or needed <= len(devices):
        return ""
    return (
        f"; on a CPU, split it into {needed} devices: the scripts' --cpu_devices={needed}, or "
        f"sharding.cpu_devices.use({needed}) before JAX starts"
    )


def make_mesh(spec: str = "", devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
    """Builds the mesh for ``spec`` over ``devices`` (default: all devices of all processes).

    Axis types are `Auto`: models annotate logical axes and GSPMD propagates the rest.
    """
    devices = list(devices if devices is not None else jax.devices())
    asked = parse_mesh_spec(spec)
    try:
        axes = resolve_sizes(asked, len(devices))
    except ValueError as e:
        raise ValueError(f"{e}{_cpu_split_hint(asked, devices)}") from None
    dcn = {name[len(DCN_PREFIX):]: n for name, n in axes if name.startswith(DCN_PREFIX)}
    ici = [(name, n) for name, n in axes if not name.startswith(DCN_PREFIX)]
    unknown = set(dcn) - {name for name, _ in ici}
    if unknown:
        raise ValueError(f"dcn axes {sorted(DCN_PREFIX + u for u in unknown)} have no in-slice axis of the same name")
    names = tuple(name for name, _ in ici)
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    if dcn:
        ici_shape = [n for _, n in ici]
        dcn_shape = [dcn.get(name, 1) for name, _ in ici]
        device_array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, allow_split_physical_axes=True)
        return jax.sharding.Mesh(device_array, names, axis_types=auto)
    shape = tuple(n for _, n in ici)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, names, axis_types=auto)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names, axis_types=auto)
