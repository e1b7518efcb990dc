"""Which platform the kernels target, and which Pallas backend compiles for it.

Every op in `kernels_pallas` has one module per backend: ``triton`` (Pallas lowered through Triton, on
NVIDIA and AMD GPUs) and ``mosaic_tpu`` (Pallas Mosaic, on TPUs). The platform is that of the mesh in
context (`jax.set_mesh`), else JAX's default backend; a CPU compiles neither, and runs either only in
Pallas interpret mode (how the tests check them).
"""

from __future__ import annotations

import jax

# The Pallas backend each platform compiles; a platform not listed (CPU) runs one only in interpret mode.
PLATFORM_BACKENDS = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def platform() -> str:
    """The platform kernels target: the devices of the mesh in context, else JAX's default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


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
