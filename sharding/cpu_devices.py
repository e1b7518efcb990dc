"""Several devices on one CPU: ``use(n)`` splits the host into ``n`` XLA:CPU devices that collectives can trust.

A laptop runs the sharded code paths on fake CPU devices (``jax_num_cpu_devices``). Two upstream problems of
XLA:CPU (jax 0.10, thunk runtime) make such runs abort, segfault or return another collective's data; `use`
works around both, and the test suite does the same (tests/conftest.py):

1. **Deadlocked collectives.** The ThunkExecutor orders a device's collectives by a scheduling edge only
   (xla/backends/cpu/runtime/thunk_executor.cc: "Collective communicator resource creates only a scheduling
   edge"), so a device can wait in two rendezvous at once, each on a thread of the intra-op pool, which the
   CPU client sizes to max(cores, devices) (xla/pjrt/cpu/cpu_client.cc). On a 2-core host with 8 devices,
   8 threads: when device 0 holds the 8th thread in an all-gather while device 7 has not yet entered a
   collective-permute of all 8, every thread waits and XLA aborts after its 40 s termination timeout.
   ``PJRT_NPROC`` sets the pool's core count (xla/pjrt/utils.cc DefaultThreadPoolSize): room for 8
   collectives in flight per device.
2. **Shared channel ids.** jax gives every collective inside a `jax.shard_map` the same channel id
   (`jax._src.interpreters.mlir.COLLECTIVE_CHANNEL_ID`, 1), and a function it lowers once for several call
   sites (`_lower_jaxpr_to_fun_cached`, nested jits) is inlined by XLA into copies with equal ids. XLA:CPU
   keys its in-process rendezvous by (run, devices, channel id), so two independent collective-permutes of
   one program (ring attention's K/V and dK/dV hops: 54 share channel 1) can join one rendezvous: `Check
   failed: id < num_threads (8 vs. 8)`, one permute's data in another's buffers (NaN), or a segfault.
   `install_channel_fix` lowers functions holding a collective once per call site and gives every
   collective of a lowered module a channel of its own. (XLA's own loop unrolling can still copy one.)

Both are needed only on the CPU backend with more than one device; programs lowered for a GPU or TPU keep
jax's channel ids.
"""

from __future__ import annotations

import itertools
import os

import jax

_FIRST_CHANNEL = 1 << 14  # past jax's host-callback channels
_installed = False


def use(n: int) -> None:
    """Splits the host CPU into ``n`` devices, with both workarounds; call before jax starts its backends.

    Processes started afterwards inherit the thread pool's size (``PJRT_NPROC``); the channel fix is
    per process.
    """
    if n < 1:
        raise ValueError(f"cpu devices must be at least 1, got {n}")
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 8 * n)))
    jax.config.update("jax_num_cpu_devices", n)
    if n > 1:
        install_channel_fix()


def install_channel_fix() -> bool:
    """Lowers every collective with a channel id of its own (idempotent); False where this jax moved the
    internals it replaces (it then runs as it would without the fix, rather than failing to start)."""
    global _installed
    if _installed:
        return True
    if not _upstream_as_read():
        return False
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lax import parallel
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    collectives = {p for p in vars(parallel).values() if isinstance(p, core.Primitive)}
    channel_ops = {f"stablehlo.{op}" for op in ("collective_permute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")}

    def has_collective(jaxpr) -> bool:
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        return any(
            eqn.primitive in collectives or any(has_collective(sub) for sub in core.jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns
        )

    class LoweringCache(dict):
        """jax's per-module cache of lowered functions, keeping none that holds a collective."""

        def __setitem__(self, key, value):
            if not any(isinstance(k, (core.Jaxpr, core.ClosedJaxpr)) and has_collective(k) for k in key):
                super().__setitem__(key, value)

    lower_module_upstream, module_context_init_upstream = mlir.lower_jaxpr_to_module, mlir.ModuleContext.__init__

    def lower_module(*args, **kwargs):
        """`mlir.lower_jaxpr_to_module` numbering a CPU module's collectives in walk order from `_FIRST_CHANNEL`:
        the same program gets the same ids, so a persistent compilation cache still finds it. A program for
        another platform (a GPU beside the split CPU) keeps jax's ids."""
        result = lower_module_upstream(*args, **kwargs)
        if tuple(kwargs.get("platforms", ())) != ("cpu",):
            return result
        ids = itertools.count(_FIRST_CHANNEL)

        def renumber(op):
            if op.name in channel_ops and "channel_handle" in op.opview.attributes:
                op.opview.attributes["channel_handle"] = hlo.ChannelHandle.get(next(ids), mlir.DEVICE_TO_DEVICE_TYPE, op.context)
            return ir.WalkResult.ADVANCE

        result.module.operation.walk(renumber)
        return result

    def module_context_init(self, *args, **kwargs):
        module_context_init_upstream(self, *args, **kwargs)
        cache = getattr(self, "cached_primitive_lowerings", None)
        if isinstance(cache, dict) and not isinstance(cache, LoweringCache):
            self.cached_primitive_lowerings = LoweringCache(cache)

    mlir.ModuleContext.__init__, mlir.lower_jaxpr_to_module = module_context_init, lower_module
    _installed = True
    return True


def _upstream_as_read() -> bool:
    """The jax internals the fix replaces are where jax 0.10 has them."""
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
