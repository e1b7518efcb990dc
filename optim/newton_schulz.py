"""Newton-Schulz orthogonalisation: the matrix function inside the Muon family.

For ``X = U S V^T`` Muon wants ``polar(X) = U V^T``. A quintic Newton-Schulz step applies the odd
polynomial ``p(s) = a s + b s^3 + c s^5`` to every singular value without an SVD:

    A = X X^T,    X <- a X + (b A + c A A) X,

with ``X`` oriented so that it is wide (rows <= columns) and ``A`` is the smaller Gram matrix. The
input is first scaled so that every singular value lies in (0, 1]; each step then pushes singular
values towards 1.

Coefficient presets (``coeffs=``). The band is the range of output singular values for inputs whose
singular values, divided by ``||X||_F`` (turbo: after AOL), lie in ``[floor, 1]``, found by
iterating the scalar polynomials (tests/optim/test_muon.py checks it on matrices):

============== ===== ============================================ ====== ==============
preset         steps normalisation                                floor  band
============== ===== ============================================ ====== ==============
jordan         5     X / (||X||_F + eps)                          1e-2   [0.681, 1.135]
                                                                  1e-3   [0.470, 1.203]
polar_express  5     X / (1.01 ||X||_F + eps)                     1e-3   [0.840, 1.124]
turbo          4     Frobenius, then AOL: X <- diag(r)^(-1/2) X,  1e-2   [0.972, 1.146]
                     r_i = sum_j |X X^T|_ij (so ||X||_2 <= 1)     1e-3   [0.120, 1.146]
============== ===== ============================================ ====== ==============

Polar error ``||O - U V^T||_F / sqrt(min(m, n))`` on 64 x 96 and 256 x 256 matrices:

================ ========= ================ ================
preset, steps    Gaussian  condition 1e2    condition 1e3
================ ========= ================ ================
jordan, 5        0.20      0.19             0.31 - 0.40
polar_express, 5 0.09      0.09             0.17 - 0.27
turbo, 4         0.02-0.08 0.09             0.39 - 0.43
================ ========= ================ ================

So turbo at 4 steps beats jordan at 5 on typical and moderately ill-conditioned matrices (tested)
but not on very ill-conditioned ones, where polar_express is the accurate choice.

- ``jordan``: one row (3.4445, -4.7750, 2.0315) repeated (K. Jordan, "Muon", 2024,
  https://kellerjordan.github.io/posts/muon/; the slope at 0 is maximised, so the iteration does not
  converge to 1 but to a band around it).
- ``polar_express``: the per-step minimax-optimal table of Amsel et al., "The Polar Express"
  (arXiv:2505.16932, Algorithm 1, designed for a lower bound of 1e-3), with its safety factor: every
  row but the last evaluates ``p(s / 1.01)``, and the input is divided by ``1.01 ||X||_F``.
- ``turbo``: Turbo-Muon (Boissin et al., arXiv:2512.04632; reference code
  github.com/thib-s/flash-newton-schulz): "Almost Orthogonal Layer" row rescaling (Prach & Lampert,
  arXiv:2208.03160) before the first step. It leaves X much closer to orthogonal than Frobenius
  scaling does, so one step can be dropped: the table is the 5-row Dion table (Ahn et al.,
  arXiv:2504.05295) without its first row, run for 4 steps. The Gram matrix of the AOL step is reused
  by the first Newton-Schulz step, so the preconditioning costs no extra matmul. Unlike the reference,
  the input is Frobenius-normalised before AOL (AOL is scale-invariant; this only keeps the ``eps``
  floor of the row sums meaningful for very small gradients).

A user table is any sequence of ``(a, b, c)`` rows with the ``jordan`` normalisation.

Indexing rule: step ``i`` (0-based) uses row ``min(i, len(table) - 1)``. A table longer than
``steps`` is cut after ``steps`` rows; a shorter one repeats its last row (Polar Express's rule: its
later rows converge to the classical (15/8, -10/8, 3/8) polynomial). Note that optax and Dion take the
*last* ``steps`` rows instead. ``steps=0`` means the preset's own count (a user table: its length).

`newton_schulz` works on one array of matrices ``(..., m, n)``. `orthogonalize` works on a pytree:
it brings every leaf to that form via `MatrixAxes`, can batch same-shape matrices into one call
(``batching=``) and can change their layout on the device mesh first (``sharding=``; by default
whole matrices to the devices of the mesh axes that divide their stack, `place_stack`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharding import partition


class NSPreset(NamedTuple):
    """A Newton-Schulz recipe."""

    table: tuple[tuple[float, float, float], ...]  # (a, b, c) rows, row i used at step i
    steps: int  # default number of steps
    precondition: str  # "frobenius" or "aol"
    safety: float  # the Frobenius-normalised input is further divided by this


def _safe(rows, factor):
    return tuple((a / factor, b / factor**3, c / factor**5) for a, b, c in rows)


_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
_DION = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

PRESETS: dict[str, NSPreset] = {
    "jordan": NSPreset(((3.4445, -4.7750, 2.0315),), 5, "frobenius", 1.0),
    "polar_express": NSPreset(_safe(_POLAR_EXPRESS, 1.01) + ((1.875, -1.25, 0.375),), 5, "frobenius", 1.01),
    "turbo": NSPreset(_DION[1:], 4, "aol", 1.0),
}

Coeffs = str | Sequence[Sequence[float]]
Steps = int | jax.Array
DTYPES = ("auto", "float32", "bfloat16")


def resolve(coeffs: Coeffs) -> NSPreset:
    """The `NSPreset` for a preset name or a user table of ``(a, b, c)`` rows."""
    if isinstance(coeffs, str):
        if coeffs not in PRESETS:
            raise ValueError(
                f"unknown Newton-Schulz preset {coeffs!r}; use one of {', '.join(PRESETS)} or a table of (a, b, c) rows"
            )
        return PRESETS[coeffs]
    table = np.asarray(coeffs, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] != 3:
        raise ValueError(f"a Newton-Schulz table must have shape (n, 3) with n >= 1 rows (a, b, c), got {table.shape}")
    rows = tuple(tuple(float(v) for v in row) for row in table)
    return NSPreset(rows, len(rows), "frobenius", 1.0)


def _matmul(a: jax.Array, b: jax.Array, dtype: str, spec: str = "...ij,...jk->...ik") -> jax.Array:
    """``a @ b`` with both inputs rounded to ``dtype`` and the product accumulated and returned in float32."""
    precision = jax.lax.Precision.HIGHEST if dtype == "float32" else None
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


def _gram(x: jax.Array, dtype: str) -> jax.Array:
    return _matmul(x, x, dtype, "...ik,...jk->...ij")


def _step(x: jax.Array, gram: jax.Array, row, dtype: str) -> jax.Array:
    """One iteration in float32 (coefficients never rounded); the new iterate is rounded to ``dtype`` once."""
    a, b, c = row
    poly = b * gram + c * _matmul(gram, gram, dtype)
    return (a * x.astype(jnp.float32) + _matmul(poly, x, dtype)).astype(dtype)


def _resolve_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"Newton-Schulz dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return dtype


def newton_schulz(
    x: jax.Array,
    coeffs: Coeffs = "jordan",
    steps: Steps = 0,
    *,
    eps: float = 1e-7,
    dtype: str = "float32",
) -> jax.Array:
    """Approximates ``polar(X) = U V^T`` for every matrix in ``x`` ``(..., m, n)``.

    Args:
      x: matrices on the last two axes; leading axes are batch axes.
      coeffs: a preset name (``"jordan"``, ``"polar_express"``, ``"turbo"``) or ``(a, b, c)`` rows.
      steps: iterations; 0 means the preset's own count. A traced integer is allowed (the loop then
        becomes a `jax.lax.fori_loop`), which is what `optax.inject_hyperparams` passes.
      eps: added to the Frobenius norm (and the floor of the AOL row sums).
      dtype: ``"float32"`` (matmuls at highest precision), ``"bfloat16"`` (matmul inputs in bf16, as
        in Jordan's reference, but the coefficients, the accumulation and the polynomial stay
        float32 and the iterate is rounded once per step), or ``"auto"``: float32 on CPU, bfloat16
        on accelerators. The norm is always taken in float32.

    Returns:
      The orthogonalised matrices, shape and dtype of ``x``.
    """
    if x.ndim < 2:
        raise ValueError(f"Newton-Schulz needs matrices (..., m, n), got shape {x.shape}")
    dtype = _resolve_dtype(dtype)
    preset = resolve(coeffs)
    wide = x.shape[-2] <= x.shape[-1]
    y = x.astype(jnp.float32) if wide else jnp.swapaxes(x, -1, -2).astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(jnp.square(y), axis=(-2, -1), keepdims=True))
    y = y / (norm * preset.safety + eps)
    gram = _gram(y, dtype)
    if preset.precondition == "aol":
        scale = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1), eps))
        y = y * scale[..., :, None]
        gram = gram * scale[..., :, None] * scale[..., None, :]
    table = preset.table
    y = _step(y, gram, table[0], dtype)

    if isinstance(steps, (int, np.integer)):
        steps = int(steps) or preset.steps
        if steps < 1:
            raise ValueError(f"Newton-Schulz steps must be >= 1 (or 0 for the preset's count), got {steps}")
        for i in range(1, steps):
            y = _step(y, _gram(y, dtype), table[min(i, len(table) - 1)], dtype)
    else:
        rows = jnp.asarray(table, dtype=jnp.float32)
        steps = jnp.where(steps > 0, steps, preset.steps)

        def body(i, y):
            row = rows[jnp.minimum(i, len(table) - 1)]
            return _step(y, _gram(y, dtype), (row[0], row[1], row[2]), dtype)

        y = jax.lax.fori_loop(1, steps, body, y)

    y = y if wide else jnp.swapaxes(y, -1, -2)
    return y.astype(x.dtype)


class MatrixAxes(NamedTuple):
    """Which axes of a leaf form the matrix; every other axis is a batch axis.

    The default is the repo's kernel layout ``(*batch, fan_in, fan_out)`` (optim/labels.py). Several
    axes may be merged into one side, e.g. ``MatrixAxes(fan_in=0, fan_out=(1, 2))`` for a
    ``(d_model, heads, head_dim)`` kernel. PyTorch's ``(out, in)`` layout is
    ``MatrixAxes(fan_in=-1, fan_out=-2)``.
    """

    fan_in: int | tuple[int, ...] = -2
    fan_out: int | tuple[int, ...] = -1


AxesSpec = MatrixAxes | Callable[[Any], Any] | None


def matrix_axes_tree(tree: Any, axes: AxesSpec) -> Any:
    """A `MatrixAxes` per leaf of ``tree``: ``axes`` itself, the default, or ``axes(tree)``."""
    if callable(axes) and not isinstance(axes, MatrixAxes):
        return axes(tree)
    spec = MatrixAxes() if axes is None else axes
    return jax.tree.map(lambda _: spec, tree)


def split_axes(shape: Sequence[int], axes: MatrixAxes) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(batch_axes, fan_in_axes, fan_out_axes)`` of a leaf of ``shape``, as non-negative ints."""
    ndim = len(shape)

    def norm(a):
        a = (a,) if isinstance(a, int) else tuple(a)
        if not a or any(not -ndim <= i < ndim for i in a):
            raise ValueError(f"matrix axes {axes} do not fit a leaf of shape {tuple(shape)}")
        return tuple(i % ndim for i in a)

    fan_in, fan_out = norm(axes.fan_in), norm(axes.fan_out)
    if set(fan_in) & set(fan_out) or len(set(fan_in)) != len(fan_in) or len(set(fan_out)) != len(fan_out):
        raise ValueError(f"matrix axes {axes} must name distinct fan-in and fan-out axes (leaf shape {tuple(shape)})")
    batch = tuple(i for i in range(ndim) if i not in fan_in + fan_out)
    return batch, fan_in, fan_out


def fans(shape: Sequence[int], axes: MatrixAxes) -> tuple[int, int]:
    """``(fan_in, fan_out)``: the sizes of the two sides of the matrix."""
    _, fan_in, fan_out = split_axes(shape, axes)
    return math.prod(shape[i] for i in fan_in), math.prod(shape[i] for i in fan_out)


SHARDING_MODES = ("auto", "as_is", "replicated", "owner")
BATCHING_MODES = ("auto", "same_shape", "none")


def dividing_axes(batch: int, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes, in mesh order, whose running product of sizes divides ``batch``."""
    axes, size = [], 1
    for name, n in mesh_shape.items():
        if batch % (size * n) == 0:
            axes.append(name)
            size *= n
    return tuple(axes)


def place_stack(stack: jax.Array, sharding: str) -> jax.Array:
    """Pins a stack ``(B, m, n)`` to the ``sharding`` layout under the ambient mesh.

    Applied to the input and the output of the iteration, so that GSPMD keeps the whole iteration in
    that layout instead of propagating the parameters' layout into it.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else partition.auto_axes(mesh)
    if sharding == "as_is" or not axes:
        return stack
    if sharding == "auto" and stack.shape[0] < math.prod(mesh.shape[a] for a in axes):
        axes = dividing_axes(stack.shape[0], {a: mesh.shape[a] for a in axes})
    elif sharding == "replicated":
        axes = ()
    return jax.lax.with_sharding_constraint(stack, jax.P(axes or None, None, None))


def orthogonalize(
    tree: Any,
    axes: AxesSpec = None,
    *,
    coeffs: Coeffs = "jordan",
    steps: Steps = 0,
    eps: float = 1e-7,
    dtype: str = "float32",
    batching: str = "auto",
    sharding: str = "auto",
) -> Any:
    """`newton_schulz` applied to every leaf of ``tree``, each seen as a batch of matrices.

    Each leaf is transposed and reshaped to ``(batch, fan_in, fan_out)`` from its `MatrixAxes`,
    then turned wide (the smaller side is the one contracted). Leading axes of a leaf (stacked
    layers, experts) are always one batched call.

    Batching (``batching=``): ``"same_shape"`` concatenates all matrices of equal oriented shape,
    across leaves, into one stack orthogonalised by one call (15 batched matmuls per group instead
    of per leaf), which pays where small matmuls are launch-bound (GPU, TPU). ``"none"`` runs one
    call per leaf and saves the concatenation copies, which is faster on CPU (measured 4-7% on the
    `small` tree, neutral to slightly negative on `tiny`). ``"auto"``: ``"none"`` when the default
    backend is CPU, else ``"same_shape"``.

    Sharding (``sharding=``, under the mesh set with `jax.set_mesh`; ignored without one). Each step
    computes ``A = X X^T`` (contracting the long side ``n``), ``A A`` and ``(bA + cA^2) X``
    (contracting the short side ``m``), plus one norm.

    - ``"as_is"``: Newton-Schulz runs on the matrices as they are sharded and GSPMD inserts the
      collectives. A matrix sharded along its long side (tensor parallelism of an MLP or attention
      projection on its wide axis) costs one all-reduce of the ``m x m`` Gram matrix per step plus
      one for the norm, and the rest is local: cheap, keep it. A matrix sharded along its short side
      (FSDP sharding ``embed`` of a wide kernel) needs an all-gather for every product: 15 gathers
      for 5 steps.
    - ``"replicated"``: every matrix is all-gathered once onto every device, orthogonalised
      redundantly there (no communication inside the iteration) and the result is sliced back to
      the parameter's layout for free. One all-gather of the update per step; compute is not
      divided. Good for small meshes and small matrices.
    - ``"owner"``: gather-to-owner. The stack of same-shape matrices is resharded along its batch
      axis over all mesh axes, so each device group receives whole matrices (an all-to-all),
      orthogonalises them with no further communication, and the results go back to the
      parameters' layout (the reverse all-to-all, inserted by GSPMD where the update meets the
      parameter). Compute is divided across devices, communication is two all-to-alls of the
      update (as in Moonlight's distributed Muon, arXiv:2502.16982, and Dion). A stack not
      divisible by the device count is padded by GSPMD, which pays the padding's bytes too: 4
      matrices on 8 devices move as much as ``"replicated"``.
    - ``"auto"`` (the default): ``"owner"`` for a stack of at least as many matrices as devices
      (padding then adds less than one matrix per device: 30 layers on 8 devices move as 32);
      a smaller stack goes ``"owner"`` over the mesh axes whose device count divides it
      (`dividing_axes`, in mesh order) and ``"replicated"`` over the others, never padded: 4 layers
      on ``fsdp:4,tensor:2`` go one per ``fsdp`` group, computed twice (once per ``tensor``
      device); 4 on ``fsdp:8`` replicate (padded to 8 they would move as many bytes). Without a mesh it is ``"as_is"``: nothing changes on one device. Measured on
      ``tiny`` (docs/benchmarks.md, section 6a): 1.31x AdamW's collective bytes on ``fsdp:8``
      (``as_is``: 4.33x) and 1.18x on ``fsdp:4,tensor:2`` (``as_is``: 2.80x; ``owner``: 2.21x).
    """
    if sharding not in SHARDING_MODES:
        raise ValueError(f"Newton-Schulz sharding must be one of {', '.join(SHARDING_MODES)}, got {sharding!r}")
    if batching not in BATCHING_MODES:
        raise ValueError(f"Newton-Schulz batching must be one of {', '.join(BATCHING_MODES)}, got {batching!r}")
    if batching == "auto":
        batching = "none" if jax.default_backend() == "cpu" else "same_shape"
    leaves, treedef = jax.tree.flatten(tree)
    axes_leaves = treedef.flatten_up_to(matrix_axes_tree(tree, axes))

    flat, undo = [], []
    for x, ax in zip(leaves, axes_leaves, strict=True):
        batch, fan_in, fan_out = split_axes(x.shape, ax)
        perm = batch + fan_in + fan_out
        moved_shape = tuple(x.shape[i] for i in perm)
        fi, fo = math.prod(x.shape[i] for i in fan_in), math.prod(x.shape[i] for i in fan_out)
        if min(fi, fo) < 1:
            raise ValueError(f"cannot orthogonalise an empty matrix (leaf shape {x.shape}, axes {ax})")
        m = jnp.transpose(x, perm).reshape(-1, fi, fo)
        tall = fi > fo
        flat.append(jnp.swapaxes(m, -1, -2) if tall else m)
        undo.append((perm, moved_shape, tall))

    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, m in enumerate(flat):
        key = (m.shape[1:], m.dtype) if batching == "same_shape" else (i,)
        groups.setdefault(key, []).append(i)

    out: list[jax.Array] = [None] * len(flat)  # type: ignore[list-item]
    for members in groups.values():
        stack = flat[members[0]] if len(members) == 1 else jnp.concatenate([flat[i] for i in members], axis=0)
        ortho = place_stack(newton_schulz(place_stack(stack, sharding), coeffs, steps, eps=eps, dtype=dtype), sharding)
        offset = 0
        for i in members:
            n = flat[i].shape[0]
            out[i] = ortho[offset : offset + n]
            offset += n

    result = []
    for m, (perm, moved_shape, tall) in zip(out, undo, strict=True):
        m = jnp.swapaxes(m, -1, -2) if tall else m
        result.append(jnp.transpose(m.reshape(moved_shape), np.argsort(perm)))
    return treedef.unflatten(result)
