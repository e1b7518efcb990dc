"""Test setup: eight fake CPU devices, so sharded code paths run on any laptop or CI box.

Compiled executables go to a persistent compilation cache that lives for one pytest session and is
shared by its processes (pytest-xdist workers, subprocesses that tests start): many tests train the
same `tiny` model and would otherwise spend much of their time recompiling identical programs. The
cache starts empty in every session, so nothing carries over between runs.

On a GPU box, ``SPMDLAB_TEST_PLATFORMS=cuda,cpu python -m pytest -n 0 tests/kernels_pallas`` runs the
kernel tests compiled on the GPU instead of in interpret mode. A test that needs more devices than
such a box has is marked ``@pytest.mark.devices(n)`` and skips there; ``SPMDLAB_TEST_CPU_DEVICES=1``
gives a CPU run that one device, to check the marks without a GPU. The marks are checked on every
run: a test whose meshes ask for more devices than its mark (1 unmarked) fails, naming the mark to add.

Float32 matrix products run at ``highest`` precision on accelerators (`_MATMUL_PRECISION`): XLA:GPU
and Pallas Triton compute them in TF32 by default (TPUs in bf16 passes), and the tests' bounds are
those of IEEE float32, as on a CPU.
"""

import atexit
import contextlib
import gc
import linecache
import math
import os
import shutil
import sys
import tempfile

import pytest

# jaxlib's CPU LAPACK kernels (triangular solves, eigh, qr, svd: PSGD-Kron, Shampoo, SOAP, Dion, ...) call
# scipy's OpenBLAS, and NumPy references call NumPy's. With more than one OpenBLAS thread, calls from several
# devices' threads at once queue on its thread server and its threads busy-wait for work (`exec_blas_async`,
# `blas_thread_server` were 94% of the CPU of PSGD-Kron's step on `fsdp:8`: 3.3 CPU-seconds a step, 0.26 with
# one thread). The suite's matrices are small; one OpenBLAS thread per calling thread. Set before NumPy or jax
# loads OpenBLAS (it reads the count once); subprocesses of tests inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Tracing allocates millions of short-lived objects, and at Python's default thresholds (700, 10, 10) the
# collector ran 6,961 times over tests/sharding/test_checkpoint_any_mesh.py and tests/lm/test_model.py, for
# 7.0 of their 110 CPU-seconds (5.6 in 27 full collections, which walk every object jax's caches hold); at these,
# 100 times for 1.3. The suite's peak resident memory stayed at 5.0 GB (docs/benchmarks.md 22j).
gc.set_threshold(20_000, 10, 10)

import jax  # after the OpenBLAS thread count is set

from sharding import cpu_devices  # jax only: before any backend starts

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
_CPU_DEVICES = int(os.environ.get("SPMDLAB_TEST_CPU_DEVICES", "8"))  # 1: a one-GPU box's count
_PLATFORMS = os.environ.get("SPMDLAB_TEST_PLATFORMS", "cpu")
_DEFAULT_PLATFORM = _PLATFORMS.split(",")[0]  # where tests' arrays live
_POOL_SIZED_HERE = _DEFAULT_PLATFORM == "cpu" and "PJRT_NPROC" not in os.environ
if _DEFAULT_PLATFORM == "cpu":
    # XLA:CPU's collectives deadlock on a small intra-op pool and mix up collectives that share a channel id
    # (tests/sharding/test_context_parallel.py, ring mode, aborted or segfaulted ~1 run in 3-5 under load):
    # `sharding.cpu_devices` has the workarounds, as the scripts' --cpu_devices get them.
    cpu_devices.use(_CPU_DEVICES)
else:
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES)
jax.config.update("jax_platforms", _PLATFORMS)
if _POOL_SIZED_HERE:
    # XLA:CPU sizes its pool (`PJRT_NPROC`) as its backend starts, so the processes that tests start get the
    # default back. Most run one device (CLI runs, the notebook's kernel, each process of the multi-process jobs),
    # where a pool sized for 8 devices' collectives oversubscribes the cores (the README main job, 60 steps on
    # 2 cores: 39.5 -> 31.7 s); one that splits its CPU sizes its own (`cpu_devices.use`, the scripts' --cpu_devices).
    jax.devices("cpu")
    del os.environ["PJRT_NPROC"]

# Precision of float32 matrix products per platform. `jax.lax.dot_general` reads the default at trace time
# (`canonicalize_precision`), so XLA's products and the dots inside Pallas kernels (Triton's `tl.dot` input
# precision: IEEE for HIGHEST, TF32 for DEFAULT) both run in IEEE float32. A CPU computes IEEE float32
# whatever the setting, and its programs stay as they are. (Read from the platform list, not the backend:
# starting a GPU backend in pytest-xdist's controller would take the GPU's memory.)
_MATMUL_PRECISION = {"cpu": None, "cuda": "highest", "gpu": "highest", "rocm": "highest", "tpu": "highest"}
jax.config.update("jax_default_matmul_precision", _MATMUL_PRECISION.get(_DEFAULT_PLATFORM, "highest"))

from sharding import mesh as _mesh_lib  # noqa: E402  (after the platform and device count are set)

# ---------------------------------------------------------------------------------- fast XLA:CPU compiles

# With most optimisations disabled (the suite's default, `_module_xla_passes`), XLA:CPU's MLIR fusion emitters
# cost about half of a tiny model's compile (train step of `tiny` on 8 devices: 6.4 -> 3.6 CPU-seconds) and buy
# nothing at optimisation level 0 (the step's CPU time and its losses are the same); with the passes on, the
# legacy emitters compile slower instead (11 -> 34 s), so in this process they are switched off only where the
# passes are. Processes that tests start (CLI runs, multi-process runs, the notebook's kernel) run with the
# passes off (`JAX_DISABLE_MOST_OPTIMIZATIONS` above) and get the emitters off through `XLA_FLAGS`, which this
# process has already read; a test that starts one with the passes on takes `optimized_subprocess_env`.
# Where the passes are on (tests that run many steps), LLVM optimises at level 1, not XLA:CPU's default 3: the
# `tiny` train step compiles in 5.8 s instead of 8.2 and runs as fast (100 steps of the default job at seq 32:
# 27 CPU-seconds instead of 37, the same loss to 1e-7; docs/benchmarks.md 22c).
# Where the passes are off, XLA:CPU also emits each program as one LLVM module instead of splitting it for
# parallel codegen threads: for the suite's small programs the split costs more than it saves, on cores
# the two workers already fill (tests/optim/test_common.py and tests/sharding/test_checkpoint_any_mesh.py:
# 157 -> 131 CPU-seconds; the README main job, passes on, is unchanged; docs/benchmarks.md 22j).
_FAST_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}
_FAST_XLA_FLAG = " ".join(f"--{name}={str(value).lower()}" for name, value in _FAST_OPTIONS.items())
_OPTIMIZED_LEVEL = 1


def _fast_compile_options(*args, **kwargs):
    """`jax._src.compiler.get_compile_options`, the emitters off where the passes are and LLVM at
    `_OPTIMIZED_LEVEL` where they are on, unless the call names the option."""
    options = _get_compile_options_upstream(*args, **kwargs)
    named = {name for name, _ in options.env_option_overrides}
    if _compiler._DISABLE_MOST_OPTIMIZATIONS.value:
        extra = _FAST_OPTIONS
    else:
        extra = {"xla_backend_optimization_level": _OPTIMIZED_LEVEL}
    options.env_option_overrides = [*options.env_option_overrides, *((k, v) for k, v in extra.items() if k not in named)]
    return options


def _fast_options_are_known() -> bool:
    """Whether this XLA knows the options (a later one that dropped them compiles as it would without this)."""
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=_FAST_OPTIONS)
    except Exception:  # noqa: BLE001  (XLA reports an unknown option as a generic runtime error)
        return False
    return True


# A pytest-xdist worker inherits its controller's flag, which would also reach its own optimised compiles.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "").replace(_FAST_XLA_FLAG, "").strip()
if _PLATFORMS == "cpu" and _fast_options_are_known():
    from jax._src import compiler as _compiler

    if hasattr(_compiler, "_DISABLE_MOST_OPTIMIZATIONS") and hasattr(_compiler, "get_compile_options"):
        _get_compile_options_upstream, _compiler.get_compile_options = _compiler.get_compile_options, _fast_compile_options
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_XLA_FLAG}".strip()


@pytest.fixture
def default_emitters() -> dict[str, bool]:
    """Compile options for a test whose program or rounding is XLA's own: XLA:CPU's default (fusion) emitters."""
    return {"xla_cpu_use_fusion_emitters": True} if _PLATFORMS == "cpu" else {}


@pytest.fixture
def optimized_subprocess_env() -> dict[str, str]:
    """Environment overrides for a process that runs many steps: XLA's passes, its default emitters, LLVM at
    `_OPTIMIZED_LEVEL`."""
    flags = os.environ.get("XLA_FLAGS", "").replace(_FAST_XLA_FLAG, "").strip()
    return {"JAX_DISABLE_MOST_OPTIMIZATIONS": "false", "XLA_FLAGS": f"{flags} --xla_backend_optimization_level={_OPTIMIZED_LEVEL}".strip()}


# ---------------------------------------------------------------------------------- device marks

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_devices_asked = [1]  # the most devices a mesh of the running test asked for


def _ask(n: int) -> None:
    _devices_asked[0] = max(_devices_asked[0], n)


def _resolve_sizes_counted(axes, n_devices):
    """`sharding.mesh.resolve_sizes` noting the devices the spec's explicit sizes need (``-1`` adapts: 1)."""
    _ask(math.prod(n for _, n in axes if n != -1))
    return _resolve_sizes(axes, n_devices)


def _make_mesh_counted(axis_shapes, *args, **kwargs):
    """`jax.make_mesh` noting the devices a test's own call asks for: library calls, and a test's call sized by
    ``jax.device_count()`` on its line, take what is present."""
    caller = sys._getframe(1)
    filename = os.path.abspath(caller.f_code.co_filename)
    if filename.startswith(_TESTS_DIR) or os.path.basename(filename).startswith("test_"):
        if "device_count()" not in linecache.getline(caller.f_code.co_filename, caller.f_lineno):
            _ask(math.prod(axis_shapes))
    return _jax_make_mesh(axis_shapes, *args, **kwargs)


_resolve_sizes, _mesh_lib.resolve_sizes = _mesh_lib.resolve_sizes, _resolve_sizes_counted
_jax_make_mesh, jax.make_mesh = jax.make_mesh, _make_mesh_counted


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "devices(n): needs n devices; skips where there are fewer (a one-GPU box)")
    # jax 0.11 deprecates Pallas Triton (Mosaic GPU replaces it); lowering our Triton kernels says so each time.
    config.addinivalue_line("filterwarnings", "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _marked_devices(item: pytest.Item) -> int:
    marker = item.get_closest_marker("devices")
    return 1 if marker is None else marker.args[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _devices_asked[0] = 1  # before the fixtures: a mesh that a fixture builds counts for its first test
    if jax.device_count() < _marked_devices(item):
        pytest.skip(f"needs {_marked_devices(item)} devices; this run has {jax.device_count()} ({jax.default_backend()})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Fails a test whose meshes asked for more devices than its ``devices`` mark, on any platform."""
    try:
        return (yield)
    finally:
        asked, marked = _devices_asked[0], _marked_devices(item)
        if asked > marked:
            pytest.fail(
                f"a mesh of this test asks for {asked} devices but it is marked devices({marked}) (1 unmarked): add "
                f"@pytest.mark.devices({asked}) so that runs with fewer devices skip it",
                pytrace=False,
            )


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
