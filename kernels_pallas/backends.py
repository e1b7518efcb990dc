"""Which platform the kernels target, and which Pallas backend compiles for it.

Every op in `kernels_pallas` has one module per backend: ``triton`` (Pallas lowered through Triton, on
NVIDIA and AMD GPUs) and ``mosaic_tpu`` (Pallas Mosaic, on TPUs). The platform is that of the mesh in
context (`jax.set_mesh`), else JAX's default backend; a CPU compiles neither, and runs either only in
Pallas interpret mode (how the tests check them). `gpu_target` lets a host without a GPU lower the
Triton kernels for one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# The Pallas backend each platform compiles; a platform not listed (CPU) runs one only in interpret mode.
PLATFORM_BACKENDS = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def platform() -> str:
    """The platform kernels target: the devices of the mesh in context, else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def device_kind() -> str:
    """The kind of device kernels target (e.g. ``NVIDIA H100 80GB HBM3``): the mesh's, else the first device's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.device_kind if device is not None else jax.devices()[0].device_kind


def compiles(target: str) -> bool:
    """Whether a Pallas backend compiles for platform ``target``."""
    return target in PLATFORM_BACKENDS


def choose(op: str, target: str, backend: str | None, interpret: object, known: tuple[str, ...], fix: str) -> str:
    """``backend`` if named, else ``target``'s; an error naming ``fix`` where nothing can run.

    Naming a backend lets a CPU host lower a kernel for another platform
    (``.lower(lowering_platforms=("cuda",))``) or interpret the TPU kernel. On a CPU with no backend
    named, the Triton kernel runs in interpret mode only.
    """
    if backend is None:
        if not compiles(target) and not interpret:
            raise ValueError(f"{op}: Pallas kernels do not compile for {target}: pass interpret=True (slow, for tests) or {fix}")
        backend = PLATFORM_BACKENDS.get(target, "triton")
    if backend not in known:
        raise ValueError(f"{op}: no backend {backend!r} for platform {target!r}; pass backend= one of {', '.join(known)} or {fix}")
    return backend


# The device a CPU host lowers GPU kernels for (jax >= 0.11 reads the GPU generation from it).
H100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")


@contextlib.contextmanager
def gpu_target(axis_sizes: tuple[int, ...] = (1,), axis_names: tuple[str, ...] = ("gpu",), device=H100) -> Iterator[jax.sharding.AbstractMesh]:
    """An abstract mesh of ``device`` in context, so a host without that GPU lowers kernels for it.

    Lower with ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` inside it; `platform`
    then reads ``gpu``, so the Triton backend is chosen.
    """
    mesh = jax.sharding.AbstractMesh(
        axis_sizes, axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(axis_sizes), abstract_device=device
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield mesh


def check_int32_offsets(op: str, fix: str, *arrays: jax.Array) -> None:
    """Refuses operands of ``2**31`` or more elements: Pallas Triton kernels address them with int32 offsets,
    which would wrap around silently."""
    for x in arrays:
        if x is not None and x.size >= 2**31:
            raise ValueError(
                f"{op}: an operand of shape {x.shape} has {x.size:,} >= 2**31 elements, past the int32 offsets of the "
                f"Triton kernel; {fix}"
            )
