"""Keep freed host memory in the process, so XLA:CPU's per-step buffers are not page-faulted in every step.

XLA:CPU allocates a step's temporaries (hundreds of MB for the `tiny` main job) with ``malloc`` from
its worker threads and frees them when the step ends. glibc serves such blocks with ``mmap`` (from
non-main arenas always, from the main arena above ``M_MMAP_THRESHOLD``) and returns them with
``munmap``, so every step faults every page in again: about 90,000 minor faults and a third of the
step's CPU time on the main job. One arena, no ``mmap`` for large blocks and no trimming of the heap
top make a step reuse the previous step's pages (mallopt(3)). The cost is that the process keeps
its peak heap size until it exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
    """Tunes glibc's allocator as above; call before JAX starts its backend. Returns whether it applied."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)
