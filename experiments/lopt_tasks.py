"""Inner problems for meta-training and evaluating learned optimizers (`experiments.meta_train`).

A `Task` is a family of training problems indexed by a *task key*: ``init(task_key)`` draws the
parameters, ``loss(params, task_key, step)`` the training loss on step ``step``'s batch, both pure
functions of their arguments, so one compiled unroll serves every instance and batches are the
same for every member of an ES population (common random numbers).

- ``mlp_regression``: a ReLU MLP fits a random teacher MLP (drawn from the task key) on Gaussian
  inputs, mean squared error;
- ``mlp_classification``: the same student, cross-entropy on the teacher's argmax classes;
- ``lm``: a byte-level transformer of `lm.model` (the ``tiny`` preset's architecture shrunk to the
  given width and depth) on windows of the standard-library corpus drawn at random offsets from the
  task key and step: next-token cross-entropy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm import config as config_lib
from lm import model as model_lib
from lm.data import corpus
from lm.loss import cross_entropy

CORPUS_TOKENS = 1 << 21  # the slice of the training split the LM tasks draw windows from


@dataclasses.dataclass(frozen=True)
class Task:
    """A family of inner problems; instances are indexed by a task key."""

    name: str
    init: Callable[[jax.Array], Any]
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array]


def _mlp_init(key: jax.Array, sizes: tuple[int, ...]) -> dict[str, jax.Array]:
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "kernel": jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in),
            "bias": jnp.zeros((n_out,)),
        }
    return params


def _mlp_apply(params: dict[str, Any], x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(n):
        x = x @ params[f"layer{i}"]["kernel"] + params[f"layer{i}"]["bias"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def mlp_task(kind: str, *, d_in: int = 8, width: int = 32, depth: int = 2, d_out: int = 4, batch: int = 64) -> Task:
    """``mlp_regression`` or ``mlp_classification`` with a student of ``depth`` hidden layers of ``width``."""
    student = (d_in, *[width] * depth, d_out)
    teacher = (d_in, 64, d_out)

    def data(task_key, step):
        x = jax.random.normal(jax.random.fold_in(jax.random.fold_in(task_key, 1), step), (batch, d_in))
        y = _mlp_apply(_mlp_init(jax.random.fold_in(task_key, 2), teacher), x)
        return x, y

    def loss(params, task_key, step):
        x, y = data(task_key, step)
        out = _mlp_apply(params, x)
        if kind == "mlp_regression":
            return jnp.mean(jnp.square(out - y))
        logp = jax.nn.log_softmax(out)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.argmax(y, axis=-1)[:, None], axis=-1))

    if kind not in ("mlp_regression", "mlp_classification"):
        raise ValueError(f"unknown MLP task {kind!r}; use mlp_regression or mlp_classification")
    return Task(f"{kind}-w{width}-d{depth}", lambda key: _mlp_init(jax.random.fold_in(key, 0), student), loss)


@functools.lru_cache(maxsize=1)
def _corpus_slice() -> np.ndarray:
    return np.asarray(corpus.load()["train"][:CORPUS_TOKENS], np.int32)


def lm_model_def(width: int, depth: int, seq_len: int) -> model_lib.ModelDef:
    """The ``tiny`` preset's architecture at ``width`` (heads of 16) and ``depth``, for ``seq_len`` tokens."""
    heads = max(width // 16, 1)
    cfg = config_lib.from_preset(
        "tiny",
        d_model=width,
        n_layers=depth,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=width // heads,
        mlp_dim=3 * width,
        max_seq_len=seq_len,
        attention="xla",
    )
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return model_lib.define(cfg)


def preset_model_def(preset: str, seq_len: int) -> model_lib.ModelDef:
    """A model preset of `lm.config` (e.g. ``small``), for ``seq_len`` tokens."""
    cfg = config_lib.from_preset(preset, max_seq_len=seq_len, attention="xla")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return model_lib.define(cfg)


def lm_task(*, width: int = 32, depth: int = 1, seq_len: int = 32, batch: int = 8, preset: str | None = None) -> Task:
    """A byte-level transformer LM of ``width`` and ``depth`` (or a model ``preset``) on random corpus windows."""
    model_def = preset_model_def(preset, seq_len) if preset else lm_model_def(width, depth, seq_len)
    tokens = jnp.asarray(_corpus_slice())

    def loss(params, task_key, step):
        key = jax.random.fold_in(jax.random.fold_in(task_key, 1), step)
        starts = jax.random.randint(key, (batch,), 0, tokens.shape[0] - seq_len - 1)
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice(tokens, (s,), (seq_len + 1,)))(starts)
        logits = model_lib.apply(model_def, params, windows[:, :-1])
        return cross_entropy(logits, windows[:, 1:])[0]

    return Task(preset or f"lm-w{width}-d{depth}", functools.partial(_lm_init, model_def), loss)


def _lm_init(model_def: model_lib.ModelDef, task_key: jax.Array) -> Any:
    """Parameters of ``model_def`` drawn from ``task_key`` (traceable, unlike the seed-based `lm.model.init_params`)."""
    from flax import nnx

    from lm.transformer import Transformer

    with nnx.use_eager_sharding(False):
        model = Transformer(model_def.config, rngs=nnx.Rngs(jax.random.fold_in(task_key, 0)))
    return nnx.to_pure_dict(nnx.state(model))


def family(names: str) -> list[Task]:
    """Tasks from a comma-separated list: ``mlp_regression``, ``mlp_classification``, ``lm-w<width>-d<depth>``,
    or a model preset of `lm.config` (e.g. ``small``)."""
    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name in config_lib.PRESETS:
            out.append(lm_task(preset=name))
        elif name.startswith("lm-w"):
            width, depth = name[len("lm-w") :].split("-d")
            out.append(lm_task(width=int(width), depth=int(depth)))
        else:
            out.append(mlp_task(name))
    return out
