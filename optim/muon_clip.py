"""MuonClip: Muon plus QK-clip (Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv:2507.20534).

Muon lets attention logits grow without bound in some heads. QK-clip caps them by rescaling the query
and key projections after each optimizer step. With ``S_h`` the maximum pre-softmax logit of query
head ``h`` over the step's batch (measured in the forward pass, before the update) and

    gamma_h = tau / S_h  if S_h > tau,  else 1,

the logits of head ``h`` scale by ``gamma_h`` at the next step (they are bilinear in the two kernels):

- multi-head attention (one key head per query head): ``W_q^h <- sqrt(gamma_h) W_q^h`` and
  ``W_k^h <- sqrt(gamma_h) W_k^h``, Kimi K2's rule;
- grouped-query attention (a key head shared by ``H / K`` query heads): ``W_q^h <- gamma_h W_q^h``
  and the shared key head is left alone. This is Kimi K2's rule for the key component it shares
  across heads (the rotary key of MLA: only the per-head query side is scaled, by ``gamma_h``). It
  caps exactly the heads that exceeded ``tau``, never touches the logits of the other heads of the
  group, and never enlarges a weight.

- multi-head latent attention (MLA, DeepSeek-V2; Kimi K2 Sec. 2.1): head ``h``'s logit is
  ``q_C^h . k_C^h + q_R^h . k_R`` with a per-head no-RoPE part (query columns of ``q_proj`` or
  ``q_up``, key columns of ``k_up``) and a RoPE key ``k_R`` shared by all heads. Kimi K2 scales
  ``q_C^h`` and ``k_C^h`` by ``sqrt(gamma_h)``, ``q_R^h`` by ``gamma_h`` and leaves ``k_R``
  (``k_rope_proj``) alone, so both parts, hence the logit, scale by ``gamma_h``. Each query head is
  ``d_n + d_r`` contiguous columns of the query kernel, no-RoPE part first (``lm/mla.py``); ``d_n`` is
  ``k_up``'s width per head. ``q_norm`` there normalises the query latent, before ``q_up``, and does
  not undo the rescaling.

Heads are contiguous ``head_dim``-wide column groups of the last axis of ``q_proj/kernel``
``(*layers, d_model, H * head_dim)`` and ``k_proj/kernel`` ``(*layers, d_model, K * head_dim)``; the
logits are ``(*layers, H)`` (the model's ``aux["attn_max_logits"]`` with
``model.track_attn_logits=True``). Kernels without leading layer axes (an unrolled model) take the
row of the logits given by the integer component of their path (``blocks/3/attn/...``). A QK-norm
layer would undo the rescaling, so trees with ``q_norm`` / ``k_norm`` next to the projections are
rejected.

`qk_clip` applies the rule to a parameter tree (for a training loop that clips by hand);
`scale_by_qk_clip` is the same as the last transform of an optax chain: it receives the final
updates ``u`` and returns ``(p + u) * s - p``, so ``apply_updates`` lands on the clipped weights.
`muon_clip` = ``chain(muon(...), scale_by_qk_clip(tau))`` (spec `MuonClip`); call its update as
``tx.update(grads, state, params, attn_max_logits=aux["attn_max_logits"])``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import cautious as cautious_lib
from optim import labels, spec
from optim.muon import Muon



# The model's names for each attention role (`optim.labels.ATTENTION_ROLES`), for error messages.
_Q, _K, _K_UP = (" or ".join(n for n, r in labels.ATTENTION_ROLES.items() if r == role) for role in ("q", "k", "k_up"))


class QKClipState(NamedTuple):
    """State of `scale_by_qk_clip`."""

    num_clipped: jax.Array  # int32: query heads whose max logit exceeded tau at the last step


def _per_column(per_head: jax.Array, head_dim: int) -> jax.Array:
    """``(*layers, heads)`` factors as ``(*layers, 1, heads * head_dim)`` kernel multipliers."""
    return jnp.repeat(per_head, head_dim, axis=-1)[..., None, :]


def _layer_index(path: tuple[str, ...]) -> int | None:
    for name in reversed(path):
        digits = name.rsplit("_", 1)[-1]
        if digits.isdigit():
            return int(digits)
    return None


def _locate(params: Any) -> dict[tuple[str, ...], dict[str, int]]:
    """``{attention path: {"q" | "k" | "k_up" | "norm": leaf index}}`` over the flat leaves."""
    found: dict[tuple[str, ...], dict[str, int]] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        names = labels.path_names(path)
        for j, name in enumerate(names):
            if name in labels.ATTENTION_ROLES and names[-1] == labels.KERNEL_NAME:
                found.setdefault(names[:j], {})[labels.ATTENTION_ROLES[name]] = i
            elif name in labels.QK_NORM_NAMES:
                found.setdefault(names[:j], {})["norm"] = i
    return found


def _mla_query_columns(gamma: jax.Array, nope: int, rope: int) -> jax.Array:
    """``(*layers, heads)`` factors as query-kernel multipliers: ``sqrt(gamma)`` on no-RoPE columns, ``gamma`` on RoPE ones."""
    per_head = jnp.concatenate(
        [jnp.repeat(jnp.sqrt(gamma)[..., None], nope, axis=-1), jnp.repeat(gamma[..., None], rope, axis=-1)], axis=-1
    )
    return per_head.reshape(*gamma.shape[:-1], 1, -1)


def qk_clip_scales(params: Any, attn_max_logits: jax.Array, tau: jax.typing.ArrayLike) -> tuple[Any, jax.Array]:
    """Per-column multipliers for every leaf (1.0 for leaves QK-clip does not touch).

    Returns:
      ``(scales, num_clipped)``: a tree like ``params`` whose q/k kernel leaves are arrays
      broadcastable to the kernel and whose other leaves are the scalar 1.0; and the number of
      query heads whose logit exceeded ``tau``.
    """
    logits = jnp.asarray(attn_max_logits, jnp.float32)
    if logits.ndim < 1:
        raise ValueError(f"attn_max_logits must be (*layers, n_heads), got shape {logits.shape}")
    n_heads = logits.shape[-1]
    gamma = jnp.where(logits > tau, tau / logits, 1.0)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    scales: list[Any] = [1.0] * len(leaves_with_path)
    modules = _locate(params)
    if not any("q" in m or "k" in m for m in modules.values()):
        raise ValueError(f"QK-clip found no query ({_Q}) or key ({_K}) kernel in the parameter tree")

    for where, found in modules.items():
        name = "/".join(where)
        if "k_up" in found:
            _scale_mla(scales, leaves_with_path, found, name, gamma, logits.shape)
            continue
        if "norm" in found:
            raise ValueError(
                f"QK-clip rescales {name}/{_Q} and {_K}, which the QK-norm there undoes; "
                "set model.qk_norm=False or use muon instead of muon_clip"
            )
        if "q" not in found or "k" not in found:
            raise ValueError(f"QK-clip needs both a query ({_Q}) and a key ({_K}) kernel under {name}")
        q_path, q = leaves_with_path[found["q"]]
        k = leaves_with_path[found["k"]][1]
        g = _layer_gamma(gamma, logits.shape, q_path, q.shape, name)
        head_dim, rem = divmod(q.shape[-1], n_heads)
        if rem or k.shape[-1] % head_dim or n_heads % (k.shape[-1] // head_dim):
            raise ValueError(
                f"{name}: q kernel {q.shape} and k kernel {k.shape} do not split into {n_heads} query heads "
                "and a divisor of that many key heads of equal width"
            )
        if k.shape[-1] // head_dim == n_heads:
            scales[found["q"]] = scales[found["k"]] = _per_column(jnp.sqrt(g), head_dim)
        else:
            scales[found["q"]] = _per_column(g, head_dim)
    return treedef.unflatten(scales), jnp.sum(logits > tau).astype(jnp.int32)


def _layer_gamma(gamma: jax.Array, logits_shape: tuple[int, ...], q_path: Any, q_shape: tuple[int, ...], name: str) -> jax.Array:
    """The rows of ``gamma`` that belong to the query kernel at ``q_path`` (all layers, or its own layer)."""
    layers = q_shape[:-2]
    if layers == logits_shape[:-1]:
        return gamma
    if not layers and len(logits_shape) == 2 and _layer_index(labels.path_names(q_path)) is not None:
        return gamma[_layer_index(labels.path_names(q_path))]
    raise ValueError(
        f"attn_max_logits of shape {logits_shape} does not match the query kernel {q_shape} under {name}: "
        "expected (*layers, n_heads) with the kernel's leading layer axes"
    )


def _scale_mla(scales: list[Any], leaves_with_path: list[Any], found: dict[str, int], name: str, gamma, logits_shape) -> None:
    """Kimi K2's MLA rule (module docstring) into ``scales``: query and ``k_up`` columns; the RoPE key is left alone."""
    if "q" not in found:
        raise ValueError(f"QK-clip needs the MLA query kernel ({_Q}) next to {name}/{_K_UP}")
    q_path, q = leaves_with_path[found["q"]]
    k_up = leaves_with_path[found["k_up"]][1]
    n_heads = logits_shape[-1]
    nope, rem_k = divmod(k_up.shape[-1], n_heads)
    width, rem_q = divmod(q.shape[-1], n_heads)
    if rem_k or rem_q or width <= nope:
        raise ValueError(
            f"{name}: MLA query kernel {q.shape} and k_up kernel {k_up.shape} do not split into {n_heads} heads "
            "of no-RoPE plus RoPE query columns and no-RoPE key columns"
        )
    g = _layer_gamma(gamma, logits_shape, q_path, q.shape, name)
    scales[found["q"]] = _mla_query_columns(g, nope, width - nope)
    scales[found["k_up"]] = _per_column(jnp.sqrt(g), nope)


def qk_clip(params: Any, attn_max_logits: jax.Array, tau: float = 100.0) -> Any:
    """``params`` with the query/key kernels of heads whose max logit exceeded ``tau`` rescaled."""
    scales, _ = qk_clip_scales(params, attn_max_logits, tau)
    return jax.tree.map(lambda p, s: p if isinstance(s, float) else (p * s).astype(p.dtype), params, scales)


def scale_by_qk_clip(tau: float = 100.0) -> optax.GradientTransformationExtraArgs:
    """QK-clip as the last transform of a chain; ``update`` needs ``params`` and ``attn_max_logits``."""

    def init_fn(params):
        del params
        return QKClipState(num_clipped=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, attn_max_logits=None, **extra_args):
        del state, extra_args
        if params is None:
            raise ValueError("QK-clip rescales the updated weights: pass params to update")
        if attn_max_logits is None:
            raise ValueError(
                "muon_clip needs the attention logits: set model.track_attn_logits=True and call "
                "tx.update(grads, state, params, attn_max_logits=aux['attn_max_logits'])"
            )
        scales, num_clipped = qk_clip_scales(params, attn_max_logits, tau)

        def clip(u, p, s):
            if isinstance(s, float):
                return u
            return (u * s + p * (s - 1)).astype(u.dtype)

        return jax.tree.map(clip, updates, params, scales), QKClipState(num_clipped=num_clipped)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonClip(Muon):
    """MuonClip: `optim.muon.muon` (same hyperparameters) followed by QK-clip at ``tau`` (Kimi K2: 100).

    ``cautious=True`` masks Muon's update with `optim.cautious.cautious` *before* the clip, so the
    QK-clip rescale (which need not agree in sign with the gradient) is never masked. Its ``update``
    needs ``attn_max_logits`` (``extra_args``).
    """

    learning_rate: optax.ScalarOrSchedule = 1.2e-2  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.1
    tau: float = spec.param(100.0, valid="(0, inf)", doc="the QK-clip threshold on each head's max attention logit (Kimi K2: 100).")
    cautious: bool = spec.param(False, doc="mask Muon's update (not the QK-clip) with `optim.cautious.cautious`.")

    extra_args: ClassVar[tuple[str, ...]] = ("attn_max_logits",)
    applies_cautious: ClassVar[bool] = True

    def transform(self) -> optax.GradientTransformationExtraArgs:
        inner = super().transform()
        return optax.chain(cautious_lib.cautious(inner) if self.cautious else inner, scale_by_qk_clip(self.tau))


muon_clip = spec.function(MuonClip, name="muon_clip")
