"""A per-parameter MLP learned optimizer as an optax transform (Metz et al., arXiv:2203.11860; μLO,
Therien et al., arXiv:2406.00153).

Every element of every parameter tensor gets the feature vector ``f`` of `optim.learned.features`
(gradient, parameter, momenta, second moment, Adafactor factors and the quantities normalised by them,
each normalised per tensor, and a time embedding of ``step / num_steps``). A small MLP, shared by all
elements (2 hidden layers of 32, ReLU; pure ``jnp``), maps it to a direction ``d`` and a
log-magnitude ``m``, and the update is

    u = -lr * s_T * d * exp(c1 m) * c2,        c1 = c2 = 1e-3 (the reference's exp_mult, step_mult)

with ``lr = 1`` as meta-trained and ``s_T = 1``, or for the μP-aware variant (``mup_base_fan_in =
n0 > 0``, μLO) μP's per-layer scaling of an Adam-like step (Tensor Programs V, arXiv:2203.03466,
Table 3) relative to the base width ``n0`` at which it was meta-trained (`mup_scales`): ``n0 / fan_in``
on hidden matrices and on the readout (the LM head, or the tied embedding, which is the readout too),
1 on input embeddings, norms and biases, so its steps shrink like μP's as the model widens. The
meta-parameters also hold offsets of the accumulator decays, ``decay = 1 - (1 - decay_0) exp(10 o)``
(``decay_0`` = `INITIAL_DECAYS`, the reference's ``param_to_decay(decay_to_param(decay_0) + o)``).

Only μLO's *optimizer* half is here: μLO also changes the model (a zero-initialised readout with a
``1 / width`` output multiplier), which `lm/` does not implement, so the shipped ``mulo`` weights
were meta-trained and are evaluated on standard-parametrised models (docs/benchmarks.md §10).

This is ``AdafacMLPLOpt`` of google/learned_optimization (``learned_optimizers/adafac_mlp_lopt.py``),
the reference this follows, with hidden size 32 (the reference defaults to 4) and a time embedding
relative to ``num_steps``. Its ``update`` takes ``loss`` as the reference does and, as there, leaves it
unused: every feature is per element. The state holds ``mu`` (one tree per momentum decay) and
``nu`` shaped like the parameters, so they shard like them and `optim.quantize_state` quantizes them
(``nu`` as a non-negative moment); the Adafactor factors keep the parameter's rank and shard along
its other axis. The MLP acts on the trailing feature axis only, so no parameter is reshaped.

Meta-parameters are a plain dict of arrays: `init_meta_params` draws fresh ones, `save_meta_params` /
`load_meta_params` write and read them as NumPy ``.npz`` with a JSON record next to them; the spec
`LOpt` (registered as ``lopt``) loads shipped weights from ``optim/learned/weights/``: ``mulo`` (the
default; μLO, meta-trained at base width 16, which its record names) or ``lopt`` (no μLO scaling).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import labels, shapes, spec
from optim.learned import features as feat

INITIAL_DECAYS = feat.Decays(momentum=(0.9, 0.99, 0.999), rms=(0.999,), adafactor=(0.9, 0.99, 0.999))
WEIGHTS_DIR = Path(__file__).parent / "weights"
MetaParams = dict[str, Any]


class MLPLOptState(NamedTuple):
    """State of `scale_by_mlp_lopt`."""

    count: jax.Array  # int32 step counter
    mu: tuple[optax.Updates, ...]  # one momentum tree per momentum decay, shaped like the parameters
    nu: optax.Updates  # second moment, shaped like the parameters
    row: tuple[optax.Updates, ...]  # Adafactor row factors per decay (the unfactored v for < 2 axes)
    col: tuple[optax.Updates, ...]  # Adafactor column factors per decay (size-1 for < 2 axes)


def init_meta_params(key: jax.Array, hidden_size: int = 32, hidden_layers: int = 2, *, warm_start: bool = True) -> MetaParams:
    """Meta-parameters to start meta-training from.

    MLP weights ~ truncated normal of std 1/sqrt(fan_in), zero biases and decay offsets. With
    ``warm_start`` the MLP starts as a per-tensor-normalised Adam: two hidden units of every layer
    carry ``relu(x) - relu(-x) = x`` for the feature ``x = m_0 / sqrt(nu)`` (momentum 0.9, normalised
    per tensor) to the direction output, and the random units' weights into the outputs are scaled
    by 0.01, so the first step is ``-1e-3 x`` (a sign-correct, Adam-like step) and meta-training
    starts from a working optimizer instead of a random one.
    """
    num_momenta = len(INITIAL_DECAYS.momentum)
    sizes = [feat.num_features(num_momenta, len(INITIAL_DECAYS.adafactor))]
    sizes += [hidden_size] * hidden_layers + [2]
    mlp = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, sub = jax.random.split(key)
        mlp[f"w{i}"] = jax.random.truncated_normal(sub, -2.0, 2.0, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
        mlp[f"b{i}"] = jnp.zeros((n_out,), jnp.float32)
    if warm_start:
        adam = 3 + num_momenta  # the feature m_0 * rsqrt(nu): after g, p, the momenta and nu
        last = len(sizes) - 2
        for i in range(last + 1):
            w = mlp[f"w{i}"]
            if i == last:
                w = (0.01 * w).at[:2, :].set(0.0).at[0, 0].set(1.0).at[1, 0].set(-1.0)
            else:
                rows = jnp.asarray([adam]) if i == 0 else jnp.asarray([0, 1])
                w = w.at[:, :2].set(0.0).at[rows[0], 0].set(1.0).at[rows[-1], 1].set(1.0 if i else -1.0)
                w = w.at[:2, 2:].set(0.0) if i else w
            mlp[f"w{i}"] = w
    offsets = {f"{name}_decays": jnp.zeros((len(d),), jnp.float32) for name, d in INITIAL_DECAYS._asdict().items()}
    return {"mlp": mlp, **offsets}


def decays(meta_params: MetaParams) -> feat.Decays:
    """The accumulator decays, ``1 - (1 - decay_0) exp(10 offset)`` clipped to [0, 1)."""

    def one(initial, offset):
        return jnp.clip(1 - (1 - jnp.asarray(initial, jnp.float32)) * jnp.exp(10 * offset), 0.0, 1.0 - 1e-7)

    return feat.Decays(*(one(d, meta_params[f"{n}_decays"]) for n, d in INITIAL_DECAYS._asdict().items()))


def apply_mlp(mlp: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The MLP on the trailing axis of ``x`` (ReLU between layers, none after the last)."""
    n_layers = len(mlp) // 2
    for i in range(n_layers):
        x = jnp.einsum("...i,io->...o", x, mlp[f"w{i}"]) + mlp[f"b{i}"]
        if i < n_layers - 1:
            x = jax.nn.relu(x)
    return x


def mup_scales(params: Any, base_fan_in: int) -> Any:
    """μLO's per-tensor step multipliers ``s_T`` at base width ``n0 = base_fan_in``.

    - ``n0 / fan_in`` on hidden matrices ("matrix" leaves of `optim.labels.matrix_labels`, ``fan_in``
      their second-last axis) and on an untied readout (``lm_head`` / ``unembed``, ``(fan_in, vocab)``);
    - ``n0 / width`` on a token embedding ``(vocab, width)`` when the tree has no separate readout:
      tied, it is the readout too, and a step on it moves every logit by a sum over ``width`` terms
      (left at 1, the learned step sent `small`'s loss from 5.8 to above 20 in its first 25 steps);
    - 1 on untied input embeddings, position tables, norm scales and biases.
    """
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    tied = not any(labels.is_embedding_path(path, labels.READOUT_NAMES) for path in paths)

    def scale(path, label, p):
        if label == labels.MATRIX or labels.is_embedding_path(path, labels.READOUT_NAMES):
            return base_fan_in / p.shape[-2]
        if tied and len(p.shape) == 2 and labels.is_embedding_path(path, labels.TOKEN_EMBEDDING_NAMES):
            return base_fan_in / p.shape[-1]
        return 1.0

    return jax.tree_util.tree_map_with_path(scale, labels.matrix_labels(params), params)


def scale_by_mlp_lopt(
    meta_params: MetaParams,
    num_steps: int | jax.Array,
    *,
    exp_mult: float = 1e-3,
    step_mult: float = 1e-3,
    mup_base_fan_in: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """The learned step ``-s_T d exp(exp_mult m) step_mult`` (see the module docstring).

    Args:
      meta_params: from `init_meta_params`, `load_meta_params` or meta-training (may be traced).
      num_steps: the length of the run, for the time features (may be traced).
      exp_mult: ``c1``, scale of the log-magnitude output.
      step_mult: ``c2``, scale of the step.
      mup_base_fan_in: 0 for the plain optimizer; ``n0 > 0`` for μLO's per-tensor scaling (`mup_scales`).
    """
    num_momenta, num_adafactor = len(INITIAL_DECAYS.momentum), len(INITIAL_DECAYS.adafactor)
    expected = feat.num_features(num_momenta, num_adafactor)
    if meta_params["mlp"]["w0"].shape[0] != expected:
        raise ValueError(
            f"meta_params take {meta_params['mlp']['w0'].shape[0]} features, this optimizer makes {expected}; "
            "use weights made for this version (init_meta_params, or meta-train again)"
        )

    def tensor_axes(tree):
        return [feat.tensor_axes(path, tuple(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(tree)]

    def init_fn(params):
        accs = [
            feat.init_accumulators(p, num_momenta, num_adafactor, axes)
            for p, axes in zip(jax.tree.leaves(params), tensor_axes(params), strict=True)
        ]
        treedef = jax.tree.structure(params)
        tree = lambda leaves: jax.tree.unflatten(treedef, list(leaves))  # noqa: E731
        return MLPLOptState(
            count=jnp.zeros([], jnp.int32),
            mu=tuple(tree(a.mu[k] for a in accs) for k in range(num_momenta)),
            nu=tree(a.nu for a in accs),
            row=tuple(tree(a.row[j] for a in accs) for j in range(num_adafactor)),
            col=tuple(tree(a.col[j] for a in accs) for j in range(num_adafactor)),
        )

    def update_fn(updates, state, params=None, *, loss=None, **extra_args):
        del loss, extra_args  # per-element features only, as in the reference
        if params is None:
            raise ValueError("the learned optimizer reads the parameters: call update(grads, state, params)")
        shapes.check_like(updates, state.nu, "lopt")
        treedef = jax.tree.structure(updates)
        grads, ps = treedef.flatten_up_to(updates), treedef.flatten_up_to(params)
        mus = [treedef.flatten_up_to(m) for m in state.mu]
        nus = treedef.flatten_up_to(state.nu)
        rows, cols = [treedef.flatten_up_to(r) for r in state.row], [treedef.flatten_up_to(c) for c in state.col]
        scales = treedef.flatten_up_to(mup_scales(params, mup_base_fan_in)) if mup_base_fan_in else [1.0] * len(grads)
        rates = decays(meta_params)
        time = feat.time_features(state.count, num_steps)
        steps, accs = [], []
        for i, (g, p, axes) in enumerate(zip(grads, ps, tensor_axes(updates), strict=True)):
            acc = feat.TensorAccumulators(
                tuple(m[i] for m in mus), nus[i], tuple(r[i] for r in rows), tuple(c[i] for c in cols)
            )
            acc = feat.update_accumulators(acc, g.astype(jnp.float32), rates, axes)
            out = apply_mlp(meta_params["mlp"], feat.features(p, g, acc, time, axes))
            direction, magnitude = out[..., 0], out[..., 1]
            step = direction * jnp.exp(magnitude * exp_mult) * step_mult * scales[i]
            steps.append((-step).astype(g.dtype))
            accs.append(acc)
        tree = lambda leaves: jax.tree.unflatten(treedef, list(leaves))  # noqa: E731
        new_state = MLPLOptState(
            count=optax.safe_increment(state.count),
            mu=tuple(tree(a.mu[k] for a in accs) for k in range(num_momenta)),
            nu=tree(a.nu for a in accs),
            row=tuple(tree(a.row[j] for a in accs) for j in range(num_adafactor)),
            col=tuple(tree(a.col[j] for a in accs) for j in range(num_adafactor)),
        )
        return tree(steps), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _flat(meta_params: MetaParams) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(meta_params):
        out["/".join(labels.path_names(path))] = np.asarray(leaf, np.float32)
    return out


def save_meta_params(path: str | Path, meta_params: MetaParams, record: dict[str, Any] | None = None) -> None:
    """Writes ``meta_params`` to ``path`` (``.npz``) and ``record`` (provenance) to ``path`` with ``.json``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **_flat(meta_params))
    if record is not None:
        path.with_suffix(".json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def load_meta_params(path: str | Path) -> MetaParams:
    """Meta-parameters written by `save_meta_params` (a FileNotFoundError naming the fix if absent)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no learned-optimizer weights at {path}; meta-train with experiments.meta_train or name a .npz")
    out: dict[str, Any] = {}
    with np.load(path) as data:
        for name in data.files:
            *parents, leaf = name.split("/")
            node = out
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = jnp.asarray(data[name])
    return out


def load_record(path: str | Path) -> dict[str, Any]:
    """The JSON record saved next to the weights at ``path`` (empty when there is none)."""
    record = Path(path).with_suffix(".json")
    return json.loads(record.read_text()) if record.exists() else {}


def weights_path(weights: str) -> Path:
    """``weights`` as a file: a path ending in ``.npz``, else a shipped name (``lopt``, ``mulo``)."""
    return Path(weights) if weights.endswith(".npz") else WEIGHTS_DIR / f"{weights}.npz"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LOpt(spec.OptimizerSpec):
    """The MLP learned optimizer with meta-trained weights (`scale_by_mlp_lopt`), times ``learning_rate``.

    ``learning_rate`` multiplies the learned step: 1.0 is the optimizer as meta-trained (it has its own
    schedule through its time features; use ``optimizer.schedule=constant`` to leave it alone).
    ``num_steps`` is the run's length (0 in a config: `optim.build` sets the run's, `for_run`). ``weights``: a shipped name or a
    ``.npz`` path; ``meta_params`` (from code) replaces them. Weights meta-trained as μLO (their record
    names a ``mup_base_fan_in``, e.g. the shipped ``mulo``) take μLO's per-tensor scaling at that base
    width, as they were trained. No weight decay: the learned step decides what happens to the weights.
    """

    learning_rate: optax.ScalarOrSchedule = 1.0
    weights: str = spec.param("mulo", doc='a shipped weights name (``mulo``, ``lopt``) or a ``.npz`` path.')
    num_steps: int = spec.param(0, valid="[0, inf)", doc="the run's length, for the time features; 0 in a config: the run's (`LOpt.for_run`).")
    meta_params: MetaParams | None = spec.code_only(doc='meta-parameters from code, replacing ``weights``.')

    def for_run(self, total_steps: int) -> LOpt:
        """Takes the run's length as ``num_steps`` unless it is set."""
        return self if self.num_steps else dataclasses.replace(self, num_steps=total_steps)

    def mup_base_fan_in(self) -> int:
        if self.meta_params is not None:
            return 0
        return int(load_record(weights_path(self.weights)).get("mup_base_fan_in", 0))

    def transform(self) -> optax.GradientTransformationExtraArgs:
        if isinstance(self.num_steps, int) and self.num_steps < 1:
            raise ValueError(f"{type(self).__name__} needs num_steps >= 1, the length of the run (its time features)")
        meta = self.meta_params if self.meta_params is not None else load_meta_params(weights_path(self.weights))
        return optax.chain(
            scale_by_mlp_lopt(meta, self.num_steps, mup_base_fan_in=self.mup_base_fan_in()),
            optax.scale_by_learning_rate(self.learning_rate, flip_sign=False),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuLOpt(LOpt):
    """μLO: `LOpt` with the per-tensor step scaling of `mup_scales` at ``n0 = base_fan_in``.

    ``base_fan_in`` 0 takes the width recorded with the weights (``mup_base_fan_in`` in their JSON).
    """

    base_fan_in: int = spec.param(0, valid="[0, inf)", doc="μLO's base width ``n0``; 0: the width recorded with the weights.")

    def mup_base_fan_in(self) -> int:
        base = self.base_fan_in or super().mup_base_fan_in()
        if not base:
            raise ValueError(
                f"weights {self.weights!r} record no mup_base_fan_in; set base_fan_in to the width they were meta-trained at"
            )
        return base


lopt = spec.function(LOpt, name="lopt")
mulo = spec.function(MuLOpt, name="mulo")
