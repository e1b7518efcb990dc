"""tests/conftest.py: a test whose meshes ask for more devices than its ``devices`` mark fails, naming the mark."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

CASES = '''
import jax
import pytest

from sharding import mesh as mesh_lib


def test_unmarked_two_device_mesh():
    mesh_lib.make_mesh("data:2", jax.devices()[:2])


def test_unmarked_jax_make_mesh():
    jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])


@pytest.mark.devices(2)
def test_marked_two_device_mesh():
    mesh_lib.make_mesh("data:2", jax.devices()[:2])


def test_unmarked_mesh_over_whatever_is_present():
    mesh_lib.make_mesh("data:-1")
    jax.make_mesh((jax.device_count(),), ("fsdp",))
'''


def test_a_missing_devices_mark_fails_the_test(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPMDLAB_TEST_CPU_DEVICES": "8", "SPMDLAB_TEST_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-o", "addopts=", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run([*command, str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert "2 failed, 2 passed" in out, out[-3000:]
    assert "FAILED test_cases.py::test_unmarked_two_device_mesh" in out and "FAILED test_cases.py::test_unmarked_jax_make_mesh" in out
    assert "a mesh of this test asks for 2 devices but it is marked devices(1) (1 unmarked): add @pytest.mark.devices(2)" in out
    assert "a mesh of this test asks for 4 devices but it is marked devices(1) (1 unmarked): add @pytest.mark.devices(4)" in out


def test_cpu_profile_sums_per_file_costliest_first():
    from tests import cpu_profile

    rows = [{"test": "tests/a.py::x", "cpu_s": 1.0}, {"test": "tests/b.py::y", "cpu_s": 3.0}, {"test": "tests/a.py::z", "cpu_s": 1.5}]
    assert cpu_profile.per_file(rows) == [("tests/b.py", 1, 3.0), ("tests/a.py", 2, 2.5)]


def test_fast_compiles_turn_the_fusion_emitters_and_the_codegen_split_off_only_without_xla_passes(optimized_subprocess_env):
    """The conftest's compile options: XLA:CPU's legacy emitters and one LLVM module per program where the passes
    are off (this test's default), XLA's own emitters, split and LLVM at level 1 where they are on; processes the
    tests start inherit the flags unless they ask otherwise."""
    import jax
    import pytest
    from jax._src import compiler

    if os.environ.get("SPMDLAB_TEST_PLATFORMS", "cpu") != "cpu":
        pytest.skip("XLA:CPU compile options: runs where the suite runs on the CPU only")

    def overrides() -> dict:
        return dict(compiler.get_compile_options(num_replicas=1, num_partitions=1).env_option_overrides)

    assert jax.config.read("jax_disable_most_optimizations")
    assert overrides().get("xla_cpu_use_fusion_emitters") is False
    assert overrides().get("xla_cpu_parallel_codegen_split_count") == 1
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        assert "xla_cpu_use_fusion_emitters" not in overrides()
        assert "xla_cpu_parallel_codegen_split_count" not in overrides()
        assert overrides().get("xla_backend_optimization_level") == 1
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
    assert {"--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"} <= set(os.environ["XLA_FLAGS"].split())
    assert "fusion_emitters" not in optimized_subprocess_env["XLA_FLAGS"]
    assert "codegen_split" not in optimized_subprocess_env["XLA_FLAGS"]
    assert "--xla_backend_optimization_level=1" in optimized_subprocess_env["XLA_FLAGS"].split()


def _openblas_threads() -> dict[str, int]:
    """``{library: threads}`` of every OpenBLAS loaded in this process (NumPy's and the one jaxlib's LAPACK calls)."""
    import ctypes

    getters = ("openblas_get_num_threads", "openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "scipy_openblas_get_num_threads64_")
    paths = {line.split()[-1] for line in pathlib.Path("/proc/self/maps").read_text().splitlines() if "openblas" in line.lower()}
    threads = {}
    for path in sorted(paths):
        library = ctypes.CDLL(path)
        for name in getters:
            if hasattr(library, name):
                threads[pathlib.Path(path).name] = getattr(library, name)()
    return threads


def test_openblas_runs_one_thread_per_caller():
    """The conftest sets OpenBLAS's thread count before NumPy or jaxlib loads it: jaxlib's CPU LAPACK kernels,
    called from several devices' threads at once, left OpenBLAS's own threads busy-waiting."""
    import jax
    import jax.numpy as jnp
    import pytest

    if not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("finds the loaded libraries through /proc (Linux)")
    jax.scipy.linalg.solve_triangular(jnp.eye(3), jnp.ones(3)).block_until_ready()  # jaxlib's LAPACK is loaded
    threads = _openblas_threads()
    if not threads:
        pytest.skip("no OpenBLAS in this process (NumPy and jaxlib use another BLAS)")
    assert set(threads.values()) == {int(os.environ["OPENBLAS_NUM_THREADS"])}, threads  # "1" unless the caller set it
