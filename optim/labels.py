"""Parameter labels: which optimizer family touches which parameter.

Matrix optimizers (Muon, Shampoo, SOAP, ...) only make sense for hidden weight matrices. Everything
else -- token embeddings, the LM head, norm scales, biases, scalars -- goes to an element-wise
optimizer (AdamW by default). The decision is made once, here, from each leaf's path and shape, and
combined with `optax.partition` by every matrix optimizer, and for weight decay (`decay_mask`).

Roles come from names first, ranks second: a leaf named like a vector (``scale``, ``bias``) is a
vector whatever its rank, so a scan-stacked norm scale ``(layers, d)`` or the MoE router bias
``(layers, experts)`` is treated exactly as the same leaf of an unscanned model, layer for layer.

Layout convention shared with `lm/`: a weight matrix is stored as ``(*batch, fan_in, fan_out)``
(JAX/Flax kernel layout, the transpose of PyTorch's ``(out, in)``). Leading axes are batch axes
(scan-stacked layers, expert stacks); the last two axes are the matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

MATRIX = "matrix"
ADAM = "adam"

# Leaf names of vectors that scan stacking turns into (layers, dim) arrays: never matrices, never
# decayed. lm/: RMSNorm / LayerNorm ``scale``, the MoE router's ``bias``.
VECTOR_NAMES: tuple[str, ...] = ("scale", "bias")

# Path components that mark vocabulary-sized tables: token embeddings ``(vocab, width)``, untied
# readouts (LM heads) ``(width, vocab)``, and position tables. They are matrices by shape but must never
# be orthogonalised (the tied embedding is also the LM head).
TOKEN_EMBEDDING_NAMES: tuple[str, ...] = ("embed", "embedding", "embeddings", "wte")
READOUT_NAMES: tuple[str, ...] = ("lm_head", "unembed")
# ParScale's per-stream prefix keys and values (lm/parscale.py) are learned virtual tokens, a table as
# the embedding is: element-wise, never orthogonalised.
EMBEDDING_NAMES: tuple[str, ...] = (*TOKEN_EMBEDDING_NAMES, *READOUT_NAMES, "wpe", "prefix")

# Attention projections MuonClip rescales (`optim.muon_clip`), by module name -> role: the query
# kernel ("q"), the key kernel ("k"), and MLA's (lm/mla.py) query up-projection (after a low-rank
# ``q_down``; "q") and no-RoPE key up-projection ("k_up"). Their leaf is ``KERNEL_NAME``.
ATTENTION_ROLES: dict[str, str] = {"q_proj": "q", "k_proj": "k", "q_up": "q", "k_up": "k_up"}
# Norms applied to queries / keys (QK-norm; MLA's latent norms): MuonClip leaves such layers alone.
QK_NORM_NAMES: tuple[str, ...] = ("q_norm", "k_norm")
KERNEL_NAME = "kernel"

LabelFn = Callable[[Any], Any]


def path_names(path: Sequence[Any]) -> tuple[str, ...]:
    """The string names of a `jax.tree_util` key path (dict keys, attribute names, indices)."""
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return tuple(names)


def is_vector(path: Sequence[Any], shape: Sequence[int]) -> bool:
    """Whether a leaf is a vector by role: fewer than two axes, or a vector name (`VECTOR_NAMES`)."""
    names = path_names(path)
    return len(shape) < 2 or bool(names) and names[-1].lower() in VECTOR_NAMES


def is_embedding_path(path: Sequence[Any], embedding_names: Iterable[str] = EMBEDDING_NAMES) -> bool:
    names = {n.lower() for n in path_names(path)}
    return any(e in names for e in embedding_names)


def matrix_labels(
    params: Any,
    *,
    embedding_names: Iterable[str] = EMBEDDING_NAMES,
    min_matrix_dim: int = 2,
) -> Any:
    """Labels every leaf ``"matrix"`` or ``"adam"``.

    A leaf is ``"matrix"`` when it has at least two axes, both of its last two axes have at least
    ``min_matrix_dim`` entries, its name is not a vector name (``scale``, ``bias``: a stack of
    per-layer norm scales is ``(layers, dim)`` but no matrix), and no component of its path names an
    embedding or LM head. All other leaves (embeddings, LM head, norm scales, biases, scalars) are
    ``"adam"``.

    Args:
      params: any pytree of arrays (or `jax.ShapeDtypeStruct`).
      embedding_names: path components that mark vocabulary tables.
      min_matrix_dim: smallest matrix side routed to the matrix optimizer.

    Returns:
      A pytree of the same structure with string leaves.
    """
    embedding_names = tuple(embedding_names)

    def label(path, leaf):
        shape = getattr(leaf, "shape", ())
        if len(shape) < 2 or min(shape[-2:]) < min_matrix_dim:
            return ADAM
        if is_embedding_path(path, embedding_names) or is_vector(path, shape):
            return ADAM
        return MATRIX

    return jax.tree_util.tree_map_with_path(label, params)


def matrix_mask(params: Any, **kwargs: Any) -> Any:
    """Boolean pytree: True where `matrix_labels` says ``"matrix"``."""
    return jax.tree.map(lambda label: label == MATRIX, matrix_labels(params, **kwargs))


def decay_mask(params: Any) -> Any:
    """Boolean pytree for weight decay: True for every leaf that is not a vector (`is_vector`).

    Weight matrices and embeddings are decayed; norm scales, biases and scalars never are (the
    usual LM practice), scan-stacked or not.
    """
    return jax.tree_util.tree_map_with_path(lambda path, p: not is_vector(path, getattr(p, "shape", ())), params)
