"""Test setup: eight fake CPU devices, so sharded code paths run on any laptop or CI box.

Compiled executables go to a persistent compilation cache that lives for one pytest session and is
shared by its processes (pytest-xdist workers, subprocesses that tests start): many tests train the
same `tiny` model and would otherwise spend much of their time recompiling identical programs. The
cache starts empty in every session, so nothing carries over between runs.

On a GPU box, ``SPMDLAB_TEST_PLATFORMS=cuda,cpu python -m pytest -n 0 tests/kernels_pallas`` runs the
kernel tests compiled on the GPU instead of in interpret mode. A test that needs more devices than
such a box has is marked ``@pytest.mark.devices(n)`` and skips there; ``SPMDLAB_TEST_CPU_DEVICES=1``
gives a CPU run that one device, to check the marks without a GPU.
"""

import atexit
import contextlib
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
    # Processes that tests start (CLI runs, the 2-process runs, the notebook's kernel) compile far more
    # than they run, as most tests do (`_module_xla_passes`); a test that runs many steps sets "false".
    JAX_DISABLE_MOST_OPTIMIZATIONS="true",
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_num_cpu_devices", int(os.environ.get("SPMDLAB_TEST_CPU_DEVICES", "8")))  # 1: a one-GPU box's count
jax.config.update("jax_platforms", os.environ.get("SPMDLAB_TEST_PLATFORMS", "cpu"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "devices(n): needs n devices; skips where there are fewer (a one-GPU box)")
    # jax 0.11 deprecates Pallas Triton (Mosaic GPU replaces it); lowering our Triton kernels says so each time.
    config.addinivalue_line("filterwarnings", "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("devices")
    if marker is not None and jax.device_count() < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} devices; this run has {jax.device_count()} ({jax.default_backend()})")


def _compile_fast(node: pytest.Item | pytest.Module) -> bool:
    return node.get_closest_marker("xla_optimized") is None


@contextlib.contextmanager
def _most_xla_optimizations_disabled(disabled: bool):
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", disabled)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


@pytest.fixture(scope="module", autouse=True)
def _module_xla_passes(request):
    """XLA without most optimisation passes, unless the module is marked ``xla_optimized``.

    Nearly every test compiles far more than it runs (tiny models, a few steps, Pallas kernels in
    interpret mode), and skipping the passes cuts compile time by a fifth to a third. Tests that run
    many steps are marked ``xla_optimized`` (a module's ``pytestmark`` covers its module fixtures).
    """
    with _most_xla_optimizations_disabled(_compile_fast(request.node)):
        yield


@pytest.fixture(autouse=True)
def _test_xla_passes(request):
    with _most_xla_optimizations_disabled(_compile_fast(request.node)):
        yield
