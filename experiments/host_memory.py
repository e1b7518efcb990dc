"""Keep freed host memory in the process, so XLA:CPU's per-step buffers are not page-faulted in every step.

XLA:CPU allocates a step's temporaries (hundreds of MB for the `tiny` main job) with ``malloc`` from
its worker threads and frees them when the step ends. glibc serves such blocks with ``mmap`` (from
non-main arenas always, from the main arena above ``M_MMAP_THRESHOLD``) and returns them with
``munmap``, so every step faults every page in again: about 90,000 minor faults and a third of the
step's CPU time on the main job. One arena, no ``mmap`` for large blocks and no trimming of the heap
top make a step reuse the previous step's pages (mallopt(3)). The cost is that the process keeps
its peak heap size until it exits, and one arena serialises the mallocs of every thread: right for
XLA:CPU, wrong for a process whose work runs on an accelerator, so the tuning applies only where
JAX will run on the CPU (`runs_on_cpu`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import platform

import jax

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def runs_on_cpu() -> bool:
    """Whether JAX will take the CPU as its backend, decided without starting one.

    ``JAX_PLATFORMS`` (``jax_platforms``) decides where set; otherwise JAX takes an accelerator whose
    plugin is installed (a ``jax_plugins`` entry point or namespace package, CUDA / ROCm; ``libtpu``).
    """
    platforms = jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    plugins = list(importlib.metadata.entry_points(group="jax_plugins"))
    return not plugins and not any(importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))


def keep_freed_memory() -> bool:
    """Tunes glibc's allocator as above where JAX runs on the CPU; call before JAX starts its backend.

    Returns whether it applied.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not runs_on_cpu():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)
