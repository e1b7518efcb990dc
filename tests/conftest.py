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
import itertools
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

import jax  # after the OpenBLAS thread count is set

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
jax.config.update("jax_num_cpu_devices", _CPU_DEVICES)
# Workaround for an XLA:CPU deadlock (jax 0.10, seen as `Fatal Python error: Aborted` or a segfault while a test
# reads a result): the ThunkExecutor orders a device's collectives by a scheduling edge only (xla/backends/cpu/
# runtime/thunk_executor.cc: "Collective communicator resource creates only a scheduling edge"), so a device can
# wait in two rendezvous at once, each on a thread of the intra-op pool; the CPU client sizes that pool to
# max(cores, devices) (xla/pjrt/cpu/cpu_client.cc: "Need at least CpuDeviceCount threads to launch one
# collective"). On a 2-core host with 8 devices, 8 threads: when device 0 holds the 8th thread in an all-gather
# while device 7 has not yet entered a collective-permute of all 8, every thread waits and XLA aborts after its
# 40 s termination timeout (tests/sharding/test_context_parallel.py, ring mode, ~1 run in 3-5 under load).
# PJRT_NPROC sets the pool's core count (xla/pjrt/utils.cc DefaultThreadPoolSize): room for 8 collectives in
# flight per device. Set before the CPU client starts; subprocesses of tests inherit it.
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 8 * _CPU_DEVICES)))
_PLATFORMS = os.environ.get("SPMDLAB_TEST_PLATFORMS", "cpu")
jax.config.update("jax_platforms", _PLATFORMS)

# Precision of float32 matrix products per platform. `jax.lax.dot_general` reads the default at trace time
# (`canonicalize_precision`), so XLA's products and the dots inside Pallas kernels (Triton's `tl.dot` input
# precision: IEEE for HIGHEST, TF32 for DEFAULT) both run in IEEE float32. A CPU computes IEEE float32
# whatever the setting, and its programs stay as they are. (Read from the platform list, not the backend:
# starting a GPU backend in pytest-xdist's controller would take the GPU's memory.)
_MATMUL_PRECISION = {"cpu": None, "cuda": "highest", "gpu": "highest", "rocm": "highest", "tpu": "highest"}
jax.config.update("jax_default_matmul_precision", _MATMUL_PRECISION.get(_PLATFORMS.split(",")[0], "highest"))

from sharding import mesh as _mesh_lib  # noqa: E402  (after the platform and device count are set)

# ---------------------------------------------------------------------------------- XLA:CPU collectives

# Workaround for an upstream bug (jax 0.10 with XLA:CPU's thunk runtime; the cause of the segfaults and aborts of
# tests/sharding/test_context_parallel.py::test_mode_equals_one_device): jax gives every collective inside a
# `jax.shard_map` the same channel id (`jax._src.interpreters.mlir.COLLECTIVE_CHANNEL_ID`, 1), and a function it
# lowers once for several call sites (`_lower_jaxpr_to_fun_cached`, nested jits) is inlined by XLA into copies
# with equal ids. XLA:CPU keys its in-process rendezvous by (run, devices, channel id), and its ThunkExecutor
# orders a device's collectives by a scheduling edge only (xla/backends/cpu/runtime/thunk_executor.cc:
# "Collective communicator resource creates only a scheduling edge"), so two independent collective-permutes of
# one program (ring attention's K/V and dK/dV hops: 54 share channel 1) can be in flight at once and join one
# rendezvous: `Check failed: id < num_threads (8 vs. 8)`, one permute's data in another's buffers (NaN), or a
# segfault. Here functions holding a collective are lowered once per call site and every collective of a lowered
# module gets a channel of its own. (XLA's own loop unrolling can still copy one; no run has collided since.)


def _has_collective(jaxpr) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return any(
        eqn.primitive in _COLLECTIVES or any(_has_collective(sub) for sub in _core.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


class _LoweringCache(dict):
    """jax's per-module cache of lowered functions, keeping none that holds a collective."""

    def __setitem__(self, key, value):
        if not any(isinstance(k, (_core.Jaxpr, _core.ClosedJaxpr)) and _has_collective(k) for k in key):
            super().__setitem__(key, value)


def _lower_module(*args, **kwargs):
    """`mlir.lower_jaxpr_to_module` giving every collective of the module a channel id of its own, in walk order
    from 2**14 (past jax's host-callback channels): the same program gets the same ids, so the persistent
    compilation cache still finds it."""
    result = _lower_module_upstream(*args, **kwargs)
    ids = itertools.count(1 << 14)

    def renumber(op):
        if op.name in _CHANNEL_OPS and "channel_handle" in op.opview.attributes:
            handle = _hlo.ChannelHandle.get(next(ids), _mlir.DEVICE_TO_DEVICE_TYPE, op.context)
            op.opview.attributes["channel_handle"] = handle
        return _ir.WalkResult.ADVANCE

    result.module.operation.walk(renumber)
    return result


def _module_context_init(self, *args, **kwargs):
    _module_context_init_upstream(self, *args, **kwargs)
    cache = getattr(self, "cached_primitive_lowerings", None)
    if isinstance(cache, dict) and not isinstance(cache, _LoweringCache):
        self.cached_primitive_lowerings = _LoweringCache(cache)


def _upstream_as_read() -> bool:
    """The jax internals the workaround replaces are where jax 0.10 has them (a later jax that moved them runs
    without it, rather than failing to start the suite)."""
    try:
        from jax._src import core
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir.dialects import hlo
    except ImportError:
        return False
    return all(
        (hasattr(core, "jaxprs_in_params"), hasattr(mlir, "lower_jaxpr_to_module"), hasattr(mlir, "DEVICE_TO_DEVICE_TYPE"),
         hasattr(mlir, "ModuleContext"), hasattr(hlo, "ChannelHandle"))
    )  # fmt: skip


if _PLATFORMS.split(",")[0] == "cpu" and _CPU_DEVICES > 1 and _upstream_as_read():
    from jax._src import core as _core
    from jax._src.interpreters import mlir as _mlir
    from jax._src.lax import parallel as _parallel
    from jax._src.lib.mlir import ir as _ir
    from jax._src.lib.mlir.dialects import hlo as _hlo

    _COLLECTIVES = {p for p in vars(_parallel).values() if isinstance(p, _core.Primitive)}
    _CHANNEL_OPS = {f"stablehlo.{op}" for op in ("collective_permute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    _module_context_init_upstream, _mlir.ModuleContext.__init__ = _mlir.ModuleContext.__init__, _module_context_init
    _lower_module_upstream, _mlir.lower_jaxpr_to_module = _mlir.lower_jaxpr_to_module, _lower_module

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
_FAST_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"
_OPTIMIZED_LEVEL = 1


def _fast_compile_options(*args, **kwargs):
    """`jax._src.compiler.get_compile_options`, the emitters off where the passes are and LLVM at
    `_OPTIMIZED_LEVEL` where they are on, unless the call names the option."""
    options = _get_compile_options_upstream(*args, **kwargs)
    named = {name for name, _ in options.env_option_overrides}
    if _compiler._DISABLE_MOST_OPTIMIZATIONS.value:
        extra = {"xla_cpu_use_fusion_emitters": False}
    else:
        extra = {"xla_backend_optimization_level": _OPTIMIZED_LEVEL}
    options.env_option_overrides = [*options.env_option_overrides, *((k, v) for k, v in extra.items() if k not in named)]
    return options


def _fusion_emitters_can_be_switched_off() -> bool:
    """Whether this XLA knows the option (a later one that dropped it compiles as it would without this)."""
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options={"xla_cpu_use_fusion_emitters": False})
    except Exception:  # noqa: BLE001  (XLA reports an unknown option as a generic runtime error)
        return False
    return True


# A pytest-xdist worker inherits its controller's flag, which would also reach its own optimised compiles.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "").replace(_FAST_XLA_FLAG, "").strip()
if _PLATFORMS == "cpu" and _fusion_emitters_can_be_switched_off():
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
