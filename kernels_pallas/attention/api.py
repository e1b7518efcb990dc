"""The attention op: `attention` picks an implementation from a table; `flash_attention` is our kernel.

`attention` runs causal softmax attention by one of `IMPLEMENTATIONS`:

- ``xla``: `reference.attention`, the definition of correct (materialises the ``(batch, heads, T, T)``
  float32 logits).
- ``cudnn``: `jax.nn.dot_product_attention(..., implementation="cudnn")` (NVIDIA GPUs; bf16/fp16,
  head_dim a multiple of 8 up to 256 on Hopper and later, 128 before, as jax checks it). cuDNN reports
  no row statistics, so tracked max logits (MuonClip) come from `reference.max_logits` (one more
  ``Q K^T`` over query blocks, no ``T x T`` buffer, no gradient).
- ``pallas``: `flash_attention` below (Triton on GPUs, Mosaic on TPUs, interpret mode on a CPU: correct
  but slow, for tests); max logits from the kernel's row maxima. GSPMD cannot partition a Pallas call,
  so the caller may pass ``per_shard`` to run it inside a `jax.shard_map`.
- ``tokamax``: `tokamax.dot_product_attention` with tokamax's own choice of kernel (Mosaic GPU on sm90+,
  its Triton kernel, XLA; `tokamax_op`), where the optional package is installed. Named only: ``auto``
  does not try it until GPU timings place it in `ORDER`.

``auto`` tries the platform's `ORDER` (platform of the mesh in context, `kernels_pallas.backends`) and
takes the first implementation whose ``unsupported`` check gives no reason; the reasons for passing
over the others are logged once each. On GPUs that is cuDNN wherever it serves, then our kernel for
bf16/fp16, and XLA for float32.

`block_implementation` picks the attention over one key block that returns its log-sum-exp
(`partial`: XLA or our kernel; never cuDNN, which cannot) for ring attention's blocks.

`flash_attention` is one `custom_vjp` over every backend's kernels. The backend follows the platform:
``triton`` on GPUs, ``mosaic_tpu`` on TPUs. On a CPU either backend runs in interpret mode only
(``interpret=True``), which is how the tests check them. The math, the recurrences and the masking are
in `base`; the definition of correct is `reference.attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas import backends, varying
from kernels_pallas.attention import base, mosaic_tpu, reference, tokamax_op, triton
from kernels_pallas.attention import window as window_lib
from kernels_pallas.attention.base import BlockSizes
from kernels_pallas.backends import platform

BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu}

__all__ = [
    "BACKENDS", "IMPLEMENTATIONS", "ORDER", "BlockSizes", "attention", "block_implementation", "choose", "flash_attention", "platform", "windowed",
]

_log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _forward(q, k, v, segment_ids, window_blocks, backend: str, spec: base.Spec):
    def run(q, k, v, segment_ids, window_blocks):  # a window's traced block count goes to the Triton kernels only
        return BACKENDS[backend].forward(q, k, v, segment_ids, spec, *(() if window_blocks is None else (window_blocks,)))

    return varying.call_opaque(run, q, k, v, segment_ids, window_blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, segment_ids, window_blocks, backend: str, spec: base.Spec):
    out, row_max, _ = _forward(q, k, v, segment_ids, window_blocks, backend, spec)
    return out, row_max


def _flash_fwd(q, k, v, segment_ids, window_blocks, backend: str, spec: base.Spec):
    out, row_max, residuals = _forward(q, k, v, segment_ids, window_blocks, backend, spec)
    return (out, row_max), residuals


def _flash_bwd(backend: str, spec: base.Spec, residuals, cotangents):
    d_out, _ = cotangents  # the row maxima are a statistic (QK-clip's input): no gradient flows through them
    dq, dk, dv = varying.call_opaque(lambda r, d: BACKENDS[backend].backward(r, d, spec), residuals, d_out)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    segment_ids: jax.Array | None = None,
    return_max_logits: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool | object = False,
    backend: str | None = None,
    window: int = 0,
    window_block: int = 1,
    window_limit: jax.Array | None = None,
):
    """Softmax attention without a ``T x T`` buffer in either direction (FlashAttention-2, arXiv:2307.08691).

    Same contract as `reference.attention`: q ``(batch, seq, heads, head_dim)``, k ``(batch, seq,
    kv_heads, head_dim)``, v ``(batch, seq, kv_heads, v_head_dim)`` (grouped-query attention reads
    each kv head for ``heads / kv_heads`` query heads without repeating it), logits and softmax
    statistics in float32 for float32, bfloat16 or float16 inputs.

    Args:
      causal: query ``i`` sees keys ``j <= i``.
      sm_scale: logit scale; default ``head_dim ** -0.5``.
      segment_ids: ``(batch, seq)`` int; queries see keys of their own segment only (packed documents).
      return_max_logits: also return the per-head maximum logit, ``(heads,)`` float32, from the
        kernel's row maxima (no extra pass); it carries no gradient.
      block_sizes: tile sizes; `None` fields take the backend's defaults.
      interpret: run the kernels in Pallas interpret mode (any platform, slow; for tests). The TPU
        backend also takes a `jax.experimental.pallas.tpu.InterpretParams`.
      backend: ``"triton"`` or ``"mosaic_tpu"``; default: the platform's (`kernels_pallas.backends`).
      window, window_block: > 0: a causal sliding window of ``window`` tokens over blocks of ``window_block``
        (`window`; the Triton backend only), key blocks outside every query's window skipped.
      window_limit: a traced window in blocks, ``[1, window / window_block]``, inside that band (a window
        that grows during training: one compilation); None: the whole band.

    Returns:
      ``(batch, seq, heads, v_head_dim)`` in q's dtype, or ``(out, max_logits)``.
    """
    reference.check_shapes(q, k, v, segment_ids)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"flash_attention takes q, k, v of one dtype among float32, bfloat16, float16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers; got {segment_ids.dtype}")
    backend = backends.choose("flash_attention", platform(), backend, interpret, tuple(BACKENDS), "use reference.attention")
    if window or window_limit is not None:
        window_lib.check_window(window, window_block)
        if not causal or backend != "triton":
            raise ValueError(f"a sliding window needs causal=True and the Triton backend, not causal={causal}, {backend}; use window.attention")
    spec = base.Spec(
        causal=causal,
        sm_scale=float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale),
        block_sizes=block_sizes or BlockSizes(),
        interpret=interpret,
        return_row_max=return_max_logits,
        window=window,
        window_block=window_block,
    )
    segment_ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    q, k, v, segment_ids = varying.unify(q, k, v, segment_ids)
    if interpret:
        varying.check_interpretable("flash_attention", "use model.attention=xla on a CPU", q)
    limit = None if window_limit is None else jnp.asarray(window_limit, jnp.int32)
    out, row_max = _flash(q, k, v, segment_ids, limit, backend, spec)
    if not return_max_logits:
        return out
    return out, jnp.max(row_max, axis=(0, 2))


# ---------------------------------------------------------------------------------- the choice

AttentionFn = Callable[..., tuple[jax.Array, jax.Array | None]]  # (q, k, v, segment_ids) -> (out, max_logits or None)


@dataclasses.dataclass(frozen=True)
class Call:
    """What a choice looks at: the operands (arrays or `jax.ShapeDtypeStruct`) and the target.

    ``training``: a gradient may be taken through the call (the attention op cannot tell from inside a
    trace, so callers that only run forward, such as decoding, say so). ``compute_capability`` (e.g.
    ``"9.0"``) and ``cudnn_version`` (e.g. ``91000`` for 9.10) are the GPU's, where known.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    platform: str
    track_max_logits: bool
    sequence_sharded: bool
    device_kind: str = ""
    has_segment_ids: bool = False
    training: bool = True
    compute_capability: str = ""
    cudnn_version: int | None = None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute attention.

    Attributes:
      run: ``run(q, k, v, segment_ids, *, track_max_logits, platform) -> (out, max_logits or None)``.
      unsupported: why ``run`` cannot serve a `Call` (None when it can), as ``auto`` sees it.
      per_shard: a Pallas call that GSPMD cannot partition: run it per shard under a mesh.
    """

    run: AttentionFn
    unsupported: Callable[[Call], str | None]
    per_shard: bool = False


def _xla(q, k, v, segment_ids=None, *, track_max_logits: bool, platform: str):
    del platform
    if track_max_logits:
        return reference.attention(q, k, v, causal=True, segment_ids=segment_ids, return_max_logits=True)
    return reference.attention(q, k, v, causal=True, segment_ids=segment_ids), None


def _cudnn(q, k, v, segment_ids=None, *, track_max_logits: bool, platform: str):
    del platform
    same_segment = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=same_segment, is_causal=True, implementation="cudnn")
    return out, reference.max_logits(q, k, causal=True, segment_ids=segment_ids) if track_max_logits else None


def _pallas(q, k, v, segment_ids=None, *, track_max_logits: bool, platform: str):
    out = flash_attention(
        q, k, v, causal=True, segment_ids=segment_ids, return_max_logits=track_max_logits, interpret=platform == "cpu"
    )
    return out if track_max_logits else (out, None)


_WHOLE_SEQUENCE = "the sequence is sharded (context parallelism) and the fused kernels need whole sequences"
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# NVIDIA parts of compute capability 9.0 and later, on which jax lets cuDNN take head_dim up to 256.
_HOPPER_OR_LATER = re.compile(r"\b(G?H100|G?H200|H800|H20|G?B[123]00|RTX PRO 6000)\b")


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _hopper_or_later(call: Call) -> bool:
    if call.compute_capability:
        return _capability(call.compute_capability) >= (9, 0)
    return bool(_HOPPER_OR_LATER.search(call.device_kind))


def cudnn_unsupported(call: Call) -> str | None:
    """Why cuDNN's fused attention cannot serve ``call`` (None when it can).

    Mirrors the checks of `jax.nn.dot_product_attention(implementation="cudnn")` and of
    ``jax/_src/cudnn/fused_attention_stablehlo.py`` (``check_layout``, ``check_is_flash_attention``;
    jax 0.10 and 0.11), so that ``auto`` falls back instead of the step raising:

    - q, k, v of one dtype, bf16 or fp16 (fp8 takes scales this op does not pass);
    - head_dim a multiple of 8, at most 256 from compute capability 9.0 on, 128 before;
    - v's head dim equal to k's (``jax.nn.dot_product_attention`` checks v against k's shape; cuDNN's
      own MLA path needs cuDNN >= 9.10 on Hopper and jax's lower-level call);
    - in training, even query and key lengths: jax refuses odd ones when the call has a bias, and a
      segment-id mask becomes one (``combine_bias_and_mask``). Its training rule is handed a
      placeholder bias even without a mask (``bias = _not_used`` before ``_dot_product_attention``),
      so the check fires for every odd length in training: ``NotImplementedError: Unsupported
      sequence length Q 127, KV 127`` on the H200 (issue 40);
    - compute capability 10.3 needs cuDNN >= 9.11;
    - no sequence sharding (its custom partitioning refuses a sharded sequence dimension).
    """
    q, k, v = call.q, call.k, call.v
    if call.sequence_sharded:
        return _WHOLE_SEQUENCE
    if call.platform == "rocm":
        return "ROCm has no cuDNN"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention takes bf16/fp16, not {q.dtype}"
    if not q.dtype == k.dtype == v.dtype:
        return f"cuDNN flash attention takes q, k, v of one dtype, not {q.dtype}/{k.dtype}/{v.dtype}"
    limit = 256 if _hopper_or_later(call) else 128
    if q.shape[-1] > limit or q.shape[-1] % 8:
        where = call.device_kind or (f"compute capability {call.compute_capability}" if call.compute_capability else "this GPU")
        return f"cuDNN flash attention takes head_dim <= {limit} and a multiple of 8 on {where}, not {q.shape[-1]}"
    if v.shape[-1] != k.shape[-1]:
        return (
            "jax.nn.dot_product_attention takes v's head dim equal to k's (cuDNN's MLA needs cuDNN >= 9.10 on Hopper), "
            f"not {k.shape[-1]}/{v.shape[-1]}"
        )
    q_len, kv_len = q.shape[1], k.shape[1]
    if call.training and (q_len % 2 or kv_len % 2):
        mask = "segment ids become a bias" if call.has_segment_ids else "jax passes its training rule a placeholder bias"
        return (
            f"cuDNN flash attention refuses odd sequence lengths in training with a bias ({mask}), "
            f"not Q {q_len}, KV {kv_len}"
        )
    if call.compute_capability == "10.3" and (call.cudnn_version or 0) < 91100:
        return f"cuDNN flash attention needs cuDNN >= 9.11 on compute capability 10.3, not {call.cudnn_version}"
    return None


def pallas_unsupported(call: Call) -> str | None:
    """Why `flash_attention` cannot serve ``call`` (None when it can).

    On GPUs the Triton kernels address operands with int32 offsets and refuse ``2**31`` or more elements
    (`backends.check_int32_offsets`); the bound here takes the largest padding the kernels apply (the
    sequence to a 128 block, head dims to a power of two >= 16).
    """
    if call.sequence_sharded:
        return _WHOLE_SEQUENCE
    if call.platform in _GPU_PLATFORMS and call.q.dtype == jnp.float32:
        return "float32 attention on a GPU runs in XLA (the Triton kernel is tuned and measured for bf16/fp16)"
    if call.platform in _GPU_PLATFORMS:
        (b, t, h, d), dv = call.q.shape, call.v.shape[-1]
        elements = b * base.round_up(t, 128) * h * max(16, 1 << (max(d, dv) - 1).bit_length())
        if elements >= 2**31:
            return f"the Triton kernel addresses its padded operands ({elements:,} elements) with int32 offsets"
    return None


IMPLEMENTATIONS = {
    "xla": Implementation(_xla, lambda call: None),
    "cudnn": Implementation(_cudnn, cudnn_unsupported),
    "pallas": Implementation(_pallas, pallas_unsupported, per_shard=True),
    "tokamax": Implementation(
        tokamax_op.run, lambda call: tokamax_op.unsupported(call.q, call.k, call.v, sequence_sharded=call.sequence_sharded), per_shard=True
    ),
}
# What ``auto`` tries, in order, per platform; the last entry of each serves every call.
ORDER = {
    "cpu": ("xla",),
    "tpu": ("pallas", "xla"),
    "gpu": ("cudnn", "pallas", "xla"),
    "cuda": ("cudnn", "pallas", "xla"),
    "rocm": ("cudnn", "pallas", "xla"),
}


def choose(
    implementation: str,
    platform: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    track_max_logits: bool,
    sequence_sharded: bool = False,
    device_kind: str = "",
    has_segment_ids: bool = False,
    training: bool = True,
    compute_capability: str = "",
    cudnn_version: int | None = None,
) -> tuple[str, str | None]:
    """``(implementation to run, why auto passed over the platform's first choices, or None)``.

    A named implementation is taken as is; ``auto`` takes the first of ``ORDER[platform]`` that
    supports the call (``xla`` on a platform not listed). The keywords are `Call`'s: ``device_kind``
    (e.g. ``NVIDIA H100 80GB HBM3``) or ``compute_capability`` set cuDNN's head_dim limit.
    """
    if implementation != "auto":
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attention implementation {implementation!r}; use one of auto, {', '.join(IMPLEMENTATIONS)}"
            )
        return implementation, None
    call = Call(
        q, k, v, platform, track_max_logits, sequence_sharded, device_kind, has_segment_ids, training, compute_capability,
        cudnn_version,
    )
    reasons: list[str] = []
    for name in ORDER.get(platform, ("xla",)):
        reason = IMPLEMENTATIONS[name].unsupported(call)
        if reason is None:
            return name, "; ".join(reasons) or None
        if reason not in reasons:
            reasons.append(reason)
    raise AssertionError(f"ORDER[{platform!r}] ends in an implementation that can refuse a call")


@functools.cache
def _gpu_versions() -> tuple[str, int | None]:
    """``(compute capability, cuDNN version)`` of this process's first GPU, ``("", None)`` where it has none
    (a CPU host lowering for an abstract GPU mesh: the device kind decides then)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return "", None
    capability = getattr(device, "compute_capability", "")
    try:  # jax's own cuDNN checks read the version here (fused_attention_stablehlo.check_cudnn_version)
        from jax._src.lib import cuda_versions

        return capability, cuda_versions.cudnn_get_version()
    except (ImportError, AttributeError):  # no CUDA plugin (ROCm), or another jax's layout: cc 10.3 then falls back
        return capability, None


_NO_LSE = {
    "cudnn": "cuDNN's fused attention (jax.nn.dot_product_attention) returns no log-sum-exp",
    "tokamax": "tokamax.dot_product_attention returns no log-sum-exp",
}


def block_implementation(implementation: str, platform: str, dtype) -> str:
    """Which per-block attention with log-sum-exp (`partial`: ``xla`` or ``pallas``) serves ``implementation``.

    Ring attention merges blocks by their lse: ``pallas`` and ``xla`` return it, cuDNN and tokamax's public
    call cannot, so ``cudnn`` and ``tokamax`` fall back (logged once) to what ``auto`` takes: the kernel on
    TPUs and for bf16/fp16 on GPUs, XLA otherwise.
    """
    if implementation not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"unknown attention implementation {implementation!r}; use one of auto, {', '.join(IMPLEMENTATIONS)}")
    if implementation in ("xla", "pallas"):
        return implementation
    kernel = platform == "tpu" or (platform in _GPU_PLATFORMS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))
    chosen = "pallas" if kernel else "xla"
    if implementation in _NO_LSE:
        reason = f"{_NO_LSE[implementation]}, which ring attention needs to merge its blocks; using {chosen} per ring block"
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            _log.warning("model.attention=%s: %s", implementation, reason)
    return chosen


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    implementation: str = "auto",
    track_max_logits: bool = False,
    sequence_sharded: bool = False,
    per_shard: Callable[[AttentionFn], AttentionFn] | None = None,
    segment_ids: jax.Array | None = None,
    training: bool = True,
    window_size: int = 0,
    window_block: int = 1,
    window_limit: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Causal softmax attention by ``implementation`` (``auto``, ``xla``, ``cudnn``, ``pallas`` or ``tokamax``).

    Args:
      q: ``(batch, seq, heads, head_dim)``; k, v: ``(batch, seq, kv_heads, head_dim)``.
      track_max_logits: also return the maximum pre-softmax logit of each query head over the
        batch and the causal (query, key) pairs, shape ``(heads,)``.
      sequence_sharded: the sequence is split over devices (the fused kernels then cannot serve).
      per_shard: wraps a ``(q, k, v, segment_ids) -> (out, max_logits)`` function that GSPMD cannot
        partition (a Pallas call) to run per shard, e.g. in a `jax.shard_map`; default: run it as is.
      segment_ids: ``(batch, seq)`` int or None; a query sees only keys of its own segment (document).
      training: a gradient may be taken through the call (``auto`` then passes over what refuses one);
        False for forward-only calls such as decoding.
      window_size: > 0: sliding-window attention over blocks of ``window_block`` tokens (`windowed`).
      window_limit: a traced number of key blocks in ``[1, window_size / window_block]`` seen by each query
        block (a window that grows during training, inside the static band of ``window_size``); None: all.

    Returns:
      ``(out, max_logits)``: out ``(batch, seq, heads, head_dim)`` in q's dtype; max_logits is None
      unless tracked.
    """
    if window_size:
        args = (implementation, window_size, window_block, track_max_logits, sequence_sharded, segment_ids, training, window_limit)
        return windowed(q, k, v, *args, per_shard=per_shard), None
    target = platform()
    gpu = target in _GPU_PLATFORMS
    capability, cudnn = _gpu_versions() if gpu else ("", None)
    chosen, reason = choose(
        implementation, target, q, k, v, track_max_logits=track_max_logits, sequence_sharded=sequence_sharded,
        device_kind=backends.device_kind() if gpu else "", has_segment_ids=segment_ids is not None, training=training,
        compute_capability=capability, cudnn_version=cudnn,
    )
    if reason is not None and reason not in _LOGGED:
        _LOGGED.add(reason)
        _log.info("model.attention=auto chose %s: %s", chosen, reason)
    impl = IMPLEMENTATIONS[chosen]
    run = functools.partial(impl.run, track_max_logits=track_max_logits, platform=target)
    if impl.per_shard and per_shard is not None:
        run = per_shard(run)
    return run(q, k, v, segment_ids)


def windowed(
    q, k, v, implementation: str, size: int, block: int, track_max_logits: bool, sequence_sharded: bool, segment_ids, training: bool,
    limit: jax.Array | None = None, per_shard: Callable[[AttentionFn], AttentionFn] | None = None,
):  # fmt: skip
    """Sliding-window attention (`window`) by the first of these that serves (``auto``), or the one named:

    - ``cudnn``: its token window (``block == 1``, a static window, on a GPU cuDNN takes: `cudnn_unsupported`);
    - ``pallas``: our Triton kernel with the window (on a GPU as `pallas_unsupported` checks, run per shard
      under ``per_shard``; on a CPU interpreted, when named only); the TPU kernel has none;
    - ``xla``: the banded computation;
    - ``tokamax``: its token window (``block == 1``, static; named only, `tokamax_op.windowed`).

    ``limit``: a traced window in blocks inside the band of ``size`` (a window growing in training), which
    the kernel and XLA take."""
    if track_max_logits or sequence_sharded:
        raise ValueError(
            "windowed attention runs on whole sequences, without tracked max logits: use model.track_attn_logits=False and "
            "no context split (or model.attention_window=0)"
        )
    target = platform()
    gpu = target in _GPU_PLATFORMS
    call = Call(
        q, k, v, target, False, False, backends.device_kind() if gpu else "", segment_ids is not None, training,
        *(_gpu_versions() if gpu else ("", None)),
    )  # fmt: skip
    if block > 1:
        cudnn_reason = f"cuDNN's sliding window is per token; a window over blocks of {block} does not fit it"
    elif limit is not None:
        cudnn_reason = "cuDNN's sliding window is static, not one that grows during training"
    else:
        cudnn_reason = cudnn_unsupported(call) if gpu else f"cuDNN needs an NVIDIA GPU, not {target}"
    if target == "tpu":
        pallas_reason = "the Mosaic TPU kernel has no window"
    elif not gpu and implementation == "auto":
        pallas_reason = f"on {target} the kernel runs interpreted only (model.attention=pallas, for tests)"
    else:
        pallas_reason = pallas_unsupported(call)
    if block > 1 or limit is not None:
        tokamax_reason = "tokamax's local window is a static token window (model.window_block=1, no growing window)"
    else:
        tokamax_reason = tokamax_op.unsupported(q, k, v, sequence_sharded=False)
    reasons = {"cudnn": cudnn_reason, "pallas": pallas_reason, "xla": None, "tokamax": tokamax_reason}
    if implementation not in reasons and implementation != "auto":
        raise ValueError(f"model.attention={implementation!r} must be one of auto, {', '.join(reasons)}")
    chosen = next(name for name, reason in reasons.items() if reason is None) if implementation == "auto" else implementation
    if reasons[chosen] is not None:
        raise ValueError(f"model.attention={chosen} cannot run this windowed attention: {reasons[chosen]}; use auto or xla")
    if implementation == "auto" and gpu and chosen != "cudnn":
        passed = "; ".join(f"{name}: {reasons[name]}" for name in ("cudnn", "pallas") if name != chosen and reasons[name])
        if passed not in _LOGGED:
            _LOGGED.add(passed)
            _log.info("model.attention=auto chose %s for windowed attention (%s)", chosen, passed)
    if chosen == "cudnn":
        return window_lib.cudnn(q, k, v, window=size, segment_ids=segment_ids)
    if chosen in ("pallas", "tokamax"):

        def run(q, k, v, segment_ids=None):
            if chosen == "tokamax":
                return tokamax_op.windowed(q, k, v, window=size, segment_ids=segment_ids), None
            kw = {"window": size, "window_block": block, "window_limit": limit, "interpret": target == "cpu"}
            out = flash_attention(q, k, v, segment_ids=segment_ids, **kw)
            return out, None

        return (run if per_shard is None else per_shard(run))(q, k, v, segment_ids)[0]
    return window_lib.attention(q, k, v, window=size, block=block, segment_ids=segment_ids, limit=limit)
