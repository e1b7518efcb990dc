"""Test setup: eight fake CPU devices, so sharded code paths run on any laptop or CI box.

Compiled executables go to a persistent compilation cache that lives for one pytest session and is
shared by its processes (pytest-xdist workers, subprocesses that tests start): many tests train the
same `tiny` model and would otherwise spend much of their time recompiling identical programs. The
cache starts empty in every session, so nothing carries over between runs.

On a GPU box, ``SPMDLAB_TEST_PLATFORMS=cuda,cpu python -m pytest -n 0 tests/kernels_pallas`` runs the
kernel tests compiled on the GPU instead of in interpret mode (the other tests expect CPU devices).
"""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

_CACHE = os.environ.get("SPMDLAB_TEST_XLA_CACHE", "")
if not _CACHE:  # the session's first pytest process (a plain run, or pytest-xdist's controller)
    _CACHE = tempfile.mkdtemp(prefix="spmdlab-test-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.update(
    SPMDLAB_TEST_XLA_CACHE=_CACHE,  # xdist workers share the controller's cache
    JAX_COMPILATION_CACHE_DIR=_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", os.environ.get("SPMDLAB_TEST_PLATFORMS", "cpu"))


@pytest.fixture(scope="module")
def fast_xla_compile():
    """XLA without most optimisation passes, for a module whose time is compilation, not running.

    Pallas kernels in interpret mode become large loop programs that the tests run once at tiny
    shapes; skipping the passes cuts their compile time by about a third.
    """
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
