"""Time one optimizer update per optimizer, relative to AdamW, on the `tiny` and `small` parameter trees.

    python -m experiments.bench_optimizer_step --optimizers=adamw,muon,normuon --trees=tiny,small \
        --json_out=/tmp/bench_optimizer_step.json
    python -m experiments.bench_optimizer_step --optimizers=all --trees=gpt2-124m --repeats=5   # a GPU's table

Each row is a jitted ``(params, grads, state) -> (params, state)`` step (update + apply_updates) on a
plain dict of random arrays with the model's parameter shapes (scan-stacked layers, tied
embedding): `TREES`' own, or a dense model preset's exactly (``gpt2-124m``, ``llama-1b``). The first call (compilation) is excluded; the time is the median of ``--repeats`` calls,
taken round-robin over the rows so that load from other processes affects every row alike.
Registered optimizers are built exactly as training builds them (`optim.build.build` on the
default optimizer config: cosine schedule, gradient clipping). Extra rows compare against other
implementations at matching settings: ``optax_muon`` is ``optax.contrib.muon`` and ``muon@optax`` is
our Muon with the same settings (EMA momentum without Nesterov, Jordan's Newton-Schulz, Jordan's
shape scale, eps 1e-8; ``ns_batching="auto"``, i.e. one Newton-Schulz call per leaf on CPU) and
``muon@optax-batched`` the same with same-shape matrices batched into one call. To add a row, add
an entry to `EXTRA_ROWS` or register the optimizer.

Shampoo's and SOAP's cost depends on whether a step refreshes the preconditioner (inverse roots,
eigenbases): the rows ``shampoo`` and ``soap`` are steps that do not refresh it (the registered
settings, with the refresh interval set beyond the timed steps), ``shampoo_refresh`` and
``soap_refresh`` steps that refresh every factor; ``<name>@k`` is the amortised cost
``((k - 1) <name> + <name>_refresh) / k`` of refreshing every ``k`` steps:

    python -m experiments.bench_optimizer_step --optimizers=adamw,shampoo,shampoo_refresh,soap,soap_refresh \
        --trees=small

With ``--train_batch=BATCHxSEQ_LEN`` every row is instead the whole training step of the model
preset named by ``--trees`` (any preset of `lm.config`; forward, backward, clipping, update:
`experiments.train_steps`'s step on random tokens at ``--train_dtype``, default attention
implementation, state carried from step to step), which is what the published overheads of
distributed Shampoo (arXiv:2002.09018) compare. Only registered rows (and their ``_refresh``
variants) can run this way:

    python -m experiments.bench_optimizer_step --optimizers=adamw,shampoo,shampoo_refresh,soap,soap_refresh \
        --trees=small --train_batch=64x256 --repeats=3
    python -m experiments.bench_optimizer_step --optimizers=adamw,muon,normuon,mars_muon,lion \
        --trees=gpt2-124m --train_batch=16x1024 --train_dtype=bfloat16 --repeats=10   # on a GPU
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import app, flags

from experiments import cli, train_steps
from experiments.configs import default
from lm import config as config_lib
from optim import build, labels, memory, registry
from optim.muon import muon

TREES = {
    "tiny": dict(d=128, layers=4, heads=4, kv_heads=2, head_dim=32, mlp=384, vocab=259),
    "small": dict(d=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=1152, vocab=259),
}
TOTAL_STEPS = 1000

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


# Rows whose preconditioner refresh is timed apart: optimizer -> its refresh-interval key.
REFRESH_INTERVAL = {"shampoo": "precondition_every", "soap": "precondition_frequency"}
NEVER = 10**6  # a refresh interval beyond any timed step
AMORTISED = {f"{name}@{k}": (name, f"{name}_refresh", k) for name in REFRESH_INTERVAL for k in (10, 100)}


def row_config(name: str) -> ml_collections.ConfigDict | None:
    """The optimizer config of a registered row (see the module docstring); None for other rows."""
    base = name.removesuffix("_refresh")
    if base not in registry.OPTIMIZERS or (base != name and base not in REFRESH_INTERVAL):
        return None
    config = default.optimizer_config(base)
    if base in REFRESH_INTERVAL:
        config[base][REFRESH_INTERVAL[base]] = 1 if base != name else NEVER
        if base == "shampoo":  # roots from the first step on, so a refresh row refreshes every step
            config.shampoo.start_preconditioning_step = 1
    return config


def registered(name: str) -> Row:
    config = row_config(name)

    def make(tree):
        return build.build(config, TOTAL_STEPS)

    if name == "muon_clip":
        return Row(make, lambda tree: {"attn_max_logits": jnp.full((tree["layers"], tree["heads"]), 50.0)})
    return Row(make)


def _optax_dims(params):
    return jax.tree.map(
        lambda label: optax.contrib.MuonDimensionNumbers(-2, -1) if label == labels.MATRIX else None,
        labels.matrix_labels(params),
    )


_SCHEDULE = optax.cosine_decay_schedule(0.02, TOTAL_STEPS)


def _muon_at_optax_settings(ns_batching: str) -> optax.GradientTransformation:
    """Our Muon with ``optax.contrib.muon``'s settings (module docstring)."""
    return muon(
        _SCHEDULE,
        nesterov=False,
        shape_scale="jordan",
        ns_eps=1e-8,
        weight_decay=0.1,
        adam_learning_rate=0.003,
        ns_batching=ns_batching,
    )


EXTRA_ROWS: dict[str, Row] = {
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
    "muon@optax": Row(lambda tree: _muon_at_optax_settings("auto")),
    "muon@optax-batched": Row(lambda tree: _muon_at_optax_settings("same_shape")),
}


def compile_row(row: Row, tree: dict[str, int]) -> Callable[[], Any]:
    """A zero-argument callable running one compiled update + apply_updates of ``row``."""
    params = param_tree(**tree)
    grads = param_tree(**tree, seed=1)
    tx = row.make(tree)
    extra = row.extra_args(tree)

    @jax.jit
    def step(params, grads, state):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    # Time the second step: the first of SOAP only initialises its bases.
    _, state = jax.block_until_ready(step(params, grads, tx.init(params)))
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


def row_names(requested: list[str], *, train_step: bool) -> list[str]:
    """The rows to time (``all``: every registered optimizer); a bad name exits with a usage error."""
    names = [n for name in requested for n in (sorted(registry.OPTIMIZERS) if name == "all" else [name])]
    for name in names:
        if row_config(name) is not None or (name in EXTRA_ROWS and not train_step):
            continue
        known = [*registry.OPTIMIZERS, *(f"{n}_refresh" for n in REFRESH_INTERVAL)]
        if train_step:
            cli.usage_exit(f"row {name!r} cannot run as a training step; --train_batch takes {', '.join(known)}")
        amortised = f" ({name} is computed from its plain and _refresh rows)" if name in AMORTISED else ""
        cli.usage_exit(f"unknown row {name!r}{amortised}; rows: {', '.join([*known, *EXTRA_ROWS])}")
    return names


def _dense_presets() -> list[str]:
    """Model presets whose parameters are `param_tree`'s: a tied embedding, grouped-query attention without QK
    norms, dense SwiGLU MLPs."""
    return [name for name in config_lib.PRESETS if _lays_out_as_param_tree(config_lib.from_preset(name))]


def _lays_out_as_param_tree(cfg: config_lib.ModelConfig) -> bool:
    return (
        cfg.tie_embeddings and cfg.attention_type == "gqa" and not cfg.qk_norm and cfg.mlp_activation == "swiglu"
        and not cfg.n_experts and not cfg.value_embeddings and cfg.parscale == 1
    )  # fmt: skip


def tree_dims(name: str) -> dict[str, int]:
    """The shapes of update tree ``name``: one of `TREES`, or a dense model preset's (`lm.config.PRESETS`)."""
    if name in TREES:
        return TREES[name]
    cfg = config_lib.from_preset(name)
    return {"d": cfg.d_model, "layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "mlp": cfg.mlp_dim, "vocab": cfg.vocab_size}


def check_trees(names: list[str], *, train_step: bool) -> None:
    """Update rows take the trees of `TREES` and the dense model presets' shapes; whole training steps any model
    preset (they build it)."""
    known = list(config_lib.PRESETS) if train_step else list(dict.fromkeys([*TREES, *_dense_presets()]))
    unknown = sorted(set(names) - set(known))
    if unknown:
        hint = "" if train_step else " (any model preset with --train_batch)"
        cli.usage_exit(f"unknown tree {unknown[0]!r}; --trees takes {', '.join(known)}{hint}")


def train_step_calls(
    names: list[str], preset: str, batch: int, seq_len: int, dtype: str = "float32"
) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    """Per row, a callable taking one more training step of ``preset`` (compute ``dtype``) with that row's
    optimizer, and the optimizer's state bytes per parameter of the model."""
    calls, state_bytes = {}, {}
    for name in names:
        config = train_steps.case_config(preset, batch, seq_len, dtype, "", "adamw", "fsdp")
        config.optimizer = row_config(name)
        steps = train_steps.compile_train_steps(config)
        steps.run(1)  # compilation, and the first step (SOAP's basis initialisation, Shampoo's first roots)
        calls[name] = functools.partial(steps.run, 1)
        params = steps.spec.model_def.abstract_params
        state = jax.eval_shape(steps.spec.tx.init, params)
        state_bytes[name] = memory.state_bytes(state) / sum(p.size for p in jax.tree.leaves(params))
    return calls, state_bytes


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    cli.quiet_logging(f.verbose)
    train_step = bool(f.train_batch)
    try:
        cli.check_counts("repeats")
        batch, seq_len = train_steps.parse_batch_shape(f.train_batch) if train_step else (0, 0)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    check_trees(f.trees, train_step=train_step)
    names = row_names(f.optimizers, train_step=train_step)
    results: dict[str, Any] = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "mode": f"train step {batch}x{seq_len}" if train_step else "update",
        "trees": {},
    }
    for tree_name in f.trees:
        if train_step:
            calls, state_bytes = train_step_calls(names, tree_name, batch, seq_len, f.train_dtype)
        else:
            tree = tree_dims(tree_name)
            rows_of = {name: EXTRA_ROWS.get(name) or registered(name) for name in names}
            calls = {name: compile_row(row, tree) for name, row in rows_of.items()}
            state_bytes = {name: state_bytes_per_param(row, tree) for name, row in rows_of.items()}
        rows = {
            name: {"ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)}
            for name, t in time_rows(calls, f.repeats).items()
        }
        for name, (plain, refresh, every) in AMORTISED.items():
            if plain in rows and refresh in rows:
                rows[name] = {"ms": ((every - 1) * rows[plain]["ms"] + rows[refresh]["ms"]) / every}
        for name, r in rows.items():
            r["state_bytes_per_param"] = state_bytes[AMORTISED[name][0] if name in AMORTISED else name]
        base = rows.get("adamw", {}).get("ms")
        for r in rows.values():
            r["vs_adamw"] = r["ms"] / base if base else None
        for name in ("muon@optax", "muon@optax-batched"):
            if name in rows and "optax_muon" in rows:
                rows[name]["vs_optax_muon"] = rows[name]["ms"] / rows["optax_muon"]["ms"]
                rows[name]["vs_optax_muon_min"] = rows[name]["min_ms"] / rows["optax_muon"]["min_ms"]
        results["trees"][tree_name] = rows

        what = f"whole training step, batch {batch}x{seq_len}" if train_step else "update + apply_updates"
        print(f"\n{tree_name}, {what} ({results['backend']}: {results['device']}), median and min of {f.repeats}")
        print(f"{'optimizer':<22}{'ms/step':>10}{'min ms':>10}{'x AdamW':>10}{'x optax':>10}{'(min)':>8}{'B/param':>9}")
        for name, r in rows.items():
            vs_adamw = f"{r['vs_adamw']:.2f}" if r["vs_adamw"] else "-"
            vs_optax = f"{r['vs_optax_muon']:.2f}" if "vs_optax_muon" in r else ""
            vs_optax_min = f"{r['vs_optax_muon_min']:.2f}" if "vs_optax_muon_min" in r else ""
            min_ms = f"{r['min_ms']:.2f}" if "min_ms" in r else "-"
            print(f"{name:<22}{r['ms']:>10.2f}{min_ms:>10}{vs_adamw:>10}{vs_optax:>10}{vs_optax_min:>8}{r['state_bytes_per_param']:>9.2f}")
    if f.json_out:
        with open(f.json_out, "w") as file:
            json.dump(results, file, indent=2)


def define_flags() -> None:
    rows = ["adamw", "muon", "normuon", "muon_clip", "mars_muon", "muon@optax", "optax_muon"]
    flags.DEFINE_list("optimizers", rows, "Rows to time; 'all': every registered optimizer.")
    flags.DEFINE_list("trees", ["tiny", "small"], f"Parameter trees, from {sorted(TREES)} or a dense model preset (gpt2-124m, llama-1b).")
    flags.DEFINE_integer("repeats", 20, "Timed calls per row (median and minimum reported).")
    cli.define_output_file_flag("json_out", "Write the results as JSON here.")
    flags.DEFINE_string(
        "train_batch", "", "BATCHxSEQ_LEN: time whole training steps of the preset named by --trees at this batch; empty: updates only."
    )
    flags.DEFINE_enum("train_dtype", "float32", ["float32", "bfloat16"], "Compute dtype of the --train_batch steps.")
    cli.define_verbose_flag()


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
