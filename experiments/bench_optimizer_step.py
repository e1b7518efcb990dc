"""Time one optimizer update per optimizer, relative to AdamW, on the `tiny` and `small` parameter trees.

    python -m experiments.bench_optimizer_step --optimizers=adamw,muon,normuon --trees=tiny,small \
        --out=/tmp/bench_optimizer_step.json

Each row is a jitted ``(params, grads, state) -> (params, state)`` step (update + apply_updates) on a
plain dict of random arrays with the model's parameter shapes (scan-stacked layers, tied
embedding). The first call (compilation) is excluded; the time is the median of ``--repeats`` calls,
taken round-robin over the rows so that load from other processes affects every row alike.
Registered optimizers are built exactly as training builds them (`optim.registry.build` on the
default optimizer config: cosine schedule, gradient clipping). Extra rows compare against other
implementations at matching settings: ``optax_muon`` is ``optax.contrib.muon`` and ``muon@optax`` is
our Muon with the same settings (EMA momentum without Nesterov, Jordan's Newton-Schulz, Jordan's
shape scale, eps 1e-8; ``ns_batching="auto"``, i.e. one Newton-Schulz call per leaf on CPU) and
``muon@optax-batched`` the same with same-shape matrices batched into one call. To add a row, add
an entry to `EXTRA_ROWS` or register the optimizer.

Shampoo's cost depends on whether a step refreshes the inverse roots: ``shampoo`` is a step without
a refresh (the registered default, first refresh at step 100), ``shampoo_refresh`` one that
recomputes every root; with both timed, ``shampoo@10`` and ``shampoo@100`` are the amortised costs
``((k - 1) shampoo + shampoo_refresh) / k`` for ``precondition_every = k``:

    python -m experiments.bench_optimizer_step --optimizers=adamw,shampoo,shampoo_refresh --trees=small
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from absl import app, flags

from experiments.configs import default
from optim import labels, memory, registry
from optim.muon import muon

TREES = {
    "tiny": dict(d=128, layers=4, heads=4, kv_heads=2, head_dim=32, mlp=384, vocab=259),
    "small": dict(d=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=1152, vocab=259),
}
TOTAL_STEPS = 1000

_OPTIMIZERS = flags.DEFINE_list(
    "optimizers", ["adamw", "muon", "normuon", "muon_clip", "mars_muon", "muon@optax", "optax_muon"], "Rows to time; 'all': every registered optimizer."
)
_TREES = flags.DEFINE_list("trees", ["tiny", "small"], f"Parameter trees, from {sorted(TREES)}.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per row (median and minimum reported).")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")


def param_tree(d, layers, heads, kv_heads, head_dim, mlp, vocab, seed=0) -> dict[str, Any]:
    """Random arrays with the model's parameter shapes (see the layout in optim/labels.py)."""
    shapes = {
        "embed": {"embedding": (vocab, d)},
        "blocks": {
            "attn_norm": {"scale": (layers, d)},
            "attn": {
                "q_proj": {"kernel": (layers, d, heads * head_dim)},
                "k_proj": {"kernel": (layers, d, kv_heads * head_dim)},
                "v_proj": {"kernel": (layers, d, kv_heads * head_dim)},
                "o_proj": {"kernel": (layers, heads * head_dim, d)},
            },
            "mlp_norm": {"scale": (layers, d)},
            "mlp": {
                "gate_proj": {"kernel": (layers, d, mlp)},
                "up_proj": {"kernel": (layers, d, mlp)},
                "down_proj": {"kernel": (layers, mlp, d)},
            },
        },
        "final_norm": {"scale": (d,)},
    }
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([0.02 * jax.random.normal(k, s) for k, s in zip(keys, leaves, strict=True)])


class Row(NamedTuple):
    """A benchmark row: the optimizer and the extra keyword arguments its update needs."""

    make: Callable[[dict[str, int]], optax.GradientTransformation]
    extra_args: Callable[[dict[str, int]], dict[str, Any]] = lambda tree: {}


def registered(name: str) -> Row:
    def make(tree):
        return registry.build(default.optimizer_config(name), TOTAL_STEPS)

    if name == "muon_clip":
        return Row(make, lambda tree: {"attn_max_logits": jnp.full((tree["layers"], tree["heads"]), 50.0)})
    return Row(make)


def _optax_dims(params):
    return jax.tree.map(
        lambda label: optax.contrib.MuonDimensionNumbers(-2, -1) if label == labels.MATRIX else None,
        labels.matrix_labels(params),
    )


def _shampoo_refreshing(tree: dict[str, int]) -> optax.GradientTransformation:
    """Registered Shampoo recomputing every inverse root at every step."""
    config = default.optimizer_config("shampoo")
    config.shampoo.precondition_every = 1
    config.shampoo.start_preconditioning_step = 1
    return registry.build(config, TOTAL_STEPS)


AMORTISED = {"shampoo@10": ("shampoo", "shampoo_refresh", 10), "shampoo@100": ("shampoo", "shampoo_refresh", 100)}

_SCHEDULE = optax.cosine_decay_schedule(0.02, TOTAL_STEPS)
EXTRA_ROWS: dict[str, Row] = {
    "shampoo_refresh": Row(_shampoo_refreshing),
    "optax_muon": Row(
        lambda tree: optax.contrib.muon(
            _SCHEDULE,
            eps=1e-8,
            nesterov=False,
            adam_b2=0.95,
            weight_decay=0.1,
            adam_weight_decay=0.1,
            adam_learning_rate=0.003,
            muon_weight_dimension_numbers=_optax_dims,
        )
    ),
    "muon@optax": Row(
        lambda tree: muon(
            _SCHEDULE,
            nesterov=False,
            shape_scale="jordan",
            ns_eps=1e-8,
            weight_decay=0.1,
            adam_learning_rate=0.003,
        )
    ),
    "muon@optax-batched": Row(
        lambda tree: muon(
            _SCHEDULE,
            nesterov=False,
            shape_scale="jordan",
            ns_eps=1e-8,
            weight_decay=0.1,
            adam_learning_rate=0.003,
            ns_batching="same_shape",
        )
    ),
}


def compile_row(row: Row, tree: dict[str, int]) -> Callable[[], Any]:
    """A zero-argument callable running one compiled update + apply_updates of ``row``."""
    params = param_tree(**tree)
    grads = param_tree(**tree, seed=1)
    tx = row.make(tree)
    extra = row.extra_args(tree)
    state = tx.init(params)

    @jax.jit
    def step(params, grads, state):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    jax.block_until_ready(step(params, grads, state))
    return lambda: jax.block_until_ready(step(params, grads, state))


def state_bytes_per_param(row: Row, tree: dict[str, int]) -> float:
    """Optimizer state bytes per parameter, from the abstract state (`optim.memory.state_bytes`)."""
    params = jax.eval_shape(lambda: param_tree(**tree))
    return memory.state_bytes(jax.eval_shape(row.make(tree).init, params)) / sum(p.size for p in jax.tree.leaves(params))


def time_rows(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of every call per row; rows are timed round-robin so machine load affects all alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv):
    del argv
    results: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "trees": {},
    }
    names = [n for name in _OPTIMIZERS.value for n in (sorted(registry.OPTIMIZERS) if name == "all" else [name])]
    for tree_name in _TREES.value:
        tree = TREES[tree_name]
        calls = {name: compile_row(EXTRA_ROWS[name] if name in EXTRA_ROWS else registered(name), tree) for name in names}
        rows = {
            name: {"ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)}
            for name, t in time_rows(calls, _REPEATS.value).items()
        }
        for name, (plain, refresh, every) in AMORTISED.items():
            if plain in rows and refresh in rows:
                rows[name] = {"ms": ((every - 1) * rows[plain]["ms"] + rows[refresh]["ms"]) / every}
        for name, r in rows.items():
            source = AMORTISED[name][0] if name in AMORTISED else name
            r["state_bytes_per_param"] = state_bytes_per_param(EXTRA_ROWS.get(source) or registered(source), tree)
        base = rows.get("adamw", {}).get("ms")
        for name, r in rows.items():
            r["vs_adamw"] = r["ms"] / base if base else None
        for name in ("muon@optax", "muon@optax-batched"):
            if name in rows and "optax_muon" in rows:
                rows[name]["vs_optax_muon"] = rows[name]["ms"] / rows["optax_muon"]["ms"]
                rows[name]["vs_optax_muon_min"] = rows[name]["min_ms"] / rows["optax_muon"]["min_ms"]
        results["trees"][tree_name] = rows

        print(f"\n{tree_name} ({results['backend']}: {results['device']}), median and min of {_REPEATS.value}")
        print(f"{'optimizer':<22}{'ms/step':>10}{'min ms':>10}{'x AdamW':>10}{'x optax':>10}{'(min)':>8}{'B/param':>9}")
        for name, r in rows.items():
            vs_adamw = f"{r['vs_adamw']:.2f}" if r["vs_adamw"] else "-"
            vs_optax = f"{r['vs_optax_muon']:.2f}" if "vs_optax_muon" in r else ""
            vs_optax_min = f"{r['vs_optax_muon_min']:.2f}" if "vs_optax_muon_min" in r else ""
            min_ms = f"{r['min_ms']:.2f}" if "min_ms" in r else "-"
            print(f"{name:<22}{r['ms']:>10.2f}{min_ms:>10}{vs_adamw:>10}{vs_optax:>10}{vs_optax_min:>8}{r['state_bytes_per_param']:>9.2f}")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
