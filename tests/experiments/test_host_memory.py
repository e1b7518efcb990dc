import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Mallocs, writes and frees a 256 MiB block twice, and prints the minor page faults of the second time.
_SECOND_TOUCH_FAULTS = """
import ctypes, ctypes.util, resource, sys
from experiments import host_memory
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def touch():
    block = libc.malloc(2**28)
    libc.memset(block, 1, 2**28)
    libc.free(block)

touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _SECOND_TOUCH_FAULTS, mode], cwd=REPO, capture_output=True, text=True, check=True, timeout=120, env=env
    )
    return int(result.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")
def test_freed_memory_is_reused_without_page_faults():
    pages = 2**28 // 4096
    assert _faults("default") > pages // 2  # glibc unmaps the freed block, so its pages fault in again
    assert _faults("keep") < pages // 100


@pytest.mark.parametrize("platforms, applies", [("cpu", True), ("cuda,cpu", False), ("tpu", False)])
def test_the_tuning_applies_only_where_jax_runs_on_the_cpu(platforms, applies):
    """A GPU or TPU process keeps glibc's per-thread arenas; the check starts no backend."""
    code = (
        "from experiments import host_memory; from jax._src import xla_bridge; "
        "print(host_memory.runs_on_cpu(), host_memory.keep_freed_memory()); assert not xla_bridge._backends"
    )
    env = {**os.environ, "JAX_PLATFORMS": platforms}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs_on_cpu, applied = result.stdout.split()
    assert runs_on_cpu == str(applies) and (applies or applied == "False")
