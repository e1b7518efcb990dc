r"""Context parallelism measured: memory per device, bytes on the wire per layer, and exactness.

    python -m experiments.bench_context --json_out=/tmp/context.json            # memory, bytes, balance
    python -m experiments.bench_context --sections=exact --exact_seq_len=2048   # the issue's exactness check

Four sections, each a Markdown table (and all of them in one JSON file):

- ``memory``: per-device temporary bytes of the compiled train step of ``tiny`` (XLA's
  ``memory_analysis().temp_size_in_bytes``; arguments and outputs are the state and batch, not
  counted) at ``context:C`` for each mode, next to one device's, against sequence length. The goal
  column is ``one device / C + K/V in flight``, with the K/V in flight of one layer per mode:
  all-gather the whole sequence's K and V, ring two blocks (the one in use and the one arriving),
  Ulysses the whole sequence's q, k, v and output for ``heads / C`` heads.
- ``bytes``: the collectives of one attention layer's forward and forward + backward (``jax.grad``)
  at ``context:C``, counted from the compiled HLO (`experiments.hlo_bytes.collectives`; ring
  algorithm bytes a device sends), next to the formula for the forward pass, with ``KV`` the bytes of
  one layer's whole-sequence K and V and ``A`` those of q, k, v and the output: ring ``(C-1)/C KV``
  (C-1 hops of one shard), all-gather the same once, Ulysses ``(C-1)/C A / C`` (four all-to-alls,
  of q, k, v and the output, each of one shard). Ring and all-gather run on the sequence in the
  model's zig-zag layout (permuted once at the model's input, `context_attention.model_order`); a
  third count, of the forward on the sequence in order, adds the relayout every call would otherwise
  pay (two ppermutes of half a shard for each of q, k, v and the output there and back: ``A / C``).
  Segment ids that travel with the keys come on top.
- ``balance``: the causal attention work of each device, zig-zag against contiguous chunks
  (`balance`).
- ``exact``: ``--exact_steps`` training steps of ``tiny`` at ``--exact_seq_len`` (random tokens,
  fixed seed) on each mesh of ``--exact_meshes`` for each mode, against one device: the largest
  relative loss difference over the steps and the largest relative gradient error (norm of the
  difference over norm, per leaf) of the first step. Ulysses splits heads over the context shards, so
  its rows (and their one-device reference) use 8 query and 8 key/value heads of width 16.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags

from experiments import cli, hlo_bytes, run_spec, timing, train_lib
from experiments.configs import default
from lm import attention as attention_lib
from lm import loss as loss_lib
from lm import model as model_lib
from lm.parallel import context_attention
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

SECTIONS = ("memory", "bytes", "balance", "exact")
_ULYSSES_HEADS = {"n_heads": 8, "n_kv_heads": 8, "head_dim": 16}
MiB = 2**20


def _config(mesh: str, mode: str, seq_len: int, batch: int, *, devices: int = 0) -> ml_collections.ConfigDict:
    config = default.get_config()
    config.model.preset = "tiny"
    config.model.max_seq_len = seq_len
    config.model.context_parallel = mode
    if mode == "ulysses":
        for key, value in _ULYSSES_HEADS.items():
            config.model[key] = value
    config.data.seq_len, config.batch_size, config.mesh, config.devices = seq_len, batch, mesh, devices
    config.rules = "tp" if "tensor" in mesh else "fsdp"
    return config


def _one_device(mode: str, seq_len: int, batch: int) -> ml_collections.ConfigDict:
    return _config("data:1", "ulysses" if mode == "ulysses" else "all_gather", seq_len, batch, devices=1)


def _compiled_step(config: ml_collections.ConfigDict):
    spec = run_spec.build_run(config)
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.abstract_state(spec.model_def, spec.tx, spec.shardings)
        batch = jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len + 1), jnp.int32, sharding=spec.shardings.batch)
        step = train_lib.make_train_step(spec.model_def, spec.tx)
        return train_lib.jit_train_step(step, spec.shardings).lower(state, batch).compile()


def memory(modes: list[str], seq_lens: list[int], shards: int) -> list[dict[str, Any]]:
    rows = []
    for seq_len in seq_lens:
        references = {"ulysses" if m == "ulysses" else "all_gather" for m in modes}
        one = {m: _compiled_step(_one_device(m, seq_len, 1)).memory_analysis().temp_size_in_bytes for m in references}
        for mode in modes:
            config = _config(f"context:{shards}", mode, seq_len, 1)
            temp = _compiled_step(config).memory_analysis().temp_size_in_bytes
            single = one["ulysses" if mode == "ulysses" else "all_gather"]
            goal = single / shards + context_attention.in_flight_bytes(mode, run_spec.model_config(config), 1, seq_len, shards)
            rows.append({
                "mode": mode, "seq_len": seq_len, "context": shards, "temp_bytes": int(temp), "one_device_temp_bytes": int(single),
                "goal_bytes": int(goal), "meets_goal": bool(temp <= goal),
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _attention_hlo(cfg, mode: str, spec: str, batch: int, seq_len: int, *, backward: bool, zigzag: bool) -> str:
    mesh, rules = mesh_lib.make_mesh(spec), rules_lib.make_rules("fsdp")
    q = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_heads, cfg.head_dim), cfg.compute_dtype)
    kv = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_kv_heads, cfg.head_dim), cfg.compute_dtype)

    def layer(q, k, v):
        return attention_lib.attend(q, k, v, context_parallel=mode, zigzag=zigzag)[0]

    fn = (lambda q, k, v: jax.grad(lambda *a: jnp.sum(layer(*a)), argnums=(0, 1, 2))(q, k, v)) if backward else layer
    with jax.set_mesh(mesh), partition.use_rules(rules):
        sharding = jax.NamedSharding(mesh, rules_lib.logical_to_mesh_spec(("batch", "seq", None, None), rules.activations, mesh.axis_names))
        args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in (q, kv, kv)]
        return jax.jit(fn).lower(*args).compile().as_text()


def wire_bytes(modes: list[str], seq_len: int, shards: int, batch: int) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        cfg = run_spec.model_config(_config(f"context:{shards}", mode, seq_len, batch))
        kv, act = context_attention.layer_bytes(cfg, batch, seq_len)
        formula = {"all_gather": (shards - 1) / shards * kv, "ring": (shards - 1) / shards * kv, "ulysses": (shards - 1) / shards * act / shards}
        zigzag = mode != "ulysses"  # the model's layout (`context_attention.model_order`)
        measured = {}
        for direction, backward, in_model_layout in (("forward", False, True), ("forward_backward", True, True), ("forward_in_order", False, False)):
            hlo = _attention_hlo(cfg, mode, f"context:{shards}", batch, seq_len, backward=backward, zigzag=zigzag and in_model_layout)
            found = hlo_bytes.collectives(hlo, shards)
            measured[direction] = {
                "ring_bytes": sum(c.ring * c.count for c in found),
                "ops": {kind: sum(c.count for c in found if c.kind == kind) for kind in {c.kind for c in found}},
            }
        rows.append({
            "mode": mode, "seq_len": seq_len, "batch": batch, "context": shards, "kv_bytes": kv, "activation_bytes": act,
            "formula_forward_bytes": formula[mode], "relayout_bytes": act / shards if zigzag else 0, **measured,
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def balance(shards: int) -> list[dict[str, Any]]:
    """Causal attention work per device, in ``(S/2C)^2`` query-key blocks, zig-zag against contiguous chunks.

    Zig-zag (ring and all-gather, `context_attention.ring_schedule`): every device computes its
    diagonal block (4 half blocks) and 2 half blocks per other device. Contiguous chunks with wholly
    masked blocks skipped: device ``i`` computes ``i + 1`` blocks of ``S/C`` (4 half blocks each).
    The forward's FLOPs are ``4 h d (S/2C)^2`` per half block (``QK^T`` and ``PV``); the step's time
    follows the busiest device.
    """
    zigzag = context_attention.ring_schedule(shards).sum(axis=(1, 2, 3))
    return [{"context": shards, "device": i, "zigzag_blocks": int(zigzag[i]), "contiguous_blocks": 4 * (i + 1)} for i in range(shards)]


def _run_steps(config: ml_collections.ConfigDict, batches: np.ndarray) -> tuple[list[float], Any]:
    """Losses of ``len(batches)`` train steps from the seed-0 state, and the gradients at that state."""
    spec = run_spec.build_run(config)
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.init_state(spec.model_def, spec.tx, 0, spec.shardings)

        def loss(params, tokens):
            logits = model_lib.apply(spec.model_def, params, tokens[:, :-1])
            return loss_lib.cross_entropy(logits, tokens[:, 1:])[0]

        put = lambda b: jax.device_put(b, spec.shardings.batch)  # noqa: E731
        grads = jax.device_get(jax.jit(jax.grad(loss))(state["params"], put(batches[0])))
        step = train_lib.jit_train_step(train_lib.make_train_step(spec.model_def, spec.tx), spec.shardings)
        losses = []
        for tokens in batches:
            state, metrics = step(state, put(tokens))
            losses.append(float(metrics["loss"]))
    return losses, grads


def exactness(modes: list[str], meshes: list[str], seq_len: int, steps: int, batch: int, attention: str = "xla") -> list[dict[str, Any]]:
    """The exactness rows; ``attention`` is ``model.attention`` on the context meshes (the reference runs XLA)."""
    vocab = run_spec.model_config(_config("data:1", "all_gather", seq_len, batch)).vocab_size
    batches = np.random.default_rng(0).integers(0, vocab, (steps, batch, seq_len + 1), dtype=np.int32)
    references, rows = {}, []
    for mode in modes:
        key = "ulysses" if mode == "ulysses" else "all_gather"
        if key not in references:
            references[key] = _run_steps(_one_device(mode, seq_len, batch), batches)
        losses_1, grads_1 = references[key]
        for mesh in meshes:
            start = time.perf_counter()
            config = _config(mesh, mode, seq_len, batch)
            config.model.attention = attention
            losses, grads = _run_steps(config, batches)
            loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, losses_1, strict=True))
            grad_error = max(
                float(np.linalg.norm(g - g_1) / np.linalg.norm(g_1))
                for g, g_1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_1), strict=True)
            )
            rows.append({
                "mode": mode, "attention": attention, "mesh": mesh, "seq_len": seq_len, "steps": steps, "losses": losses, "one_device_losses": losses_1,
                "max_loss_rel_error": loss_error, "max_grad_rel_error": grad_error, "loss_ok": loss_error <= 1e-5,
                "seconds": round(time.perf_counter() - start, 1),
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def print_tables(results: dict[str, list[dict[str, Any]]]) -> None:
    mib = lambda key: lambda r: f"{r[key] / MiB:,.1f}"  # noqa: E731
    if "memory" in results:
        print(timing.markdown_table(results["memory"], ["mode", "seq_len", "context"], {
            "temp MiB / device": mib("temp_bytes"), "one device MiB": mib("one_device_temp_bytes"),
            "goal MiB (1/C + K/V in flight)": mib("goal_bytes"), "meets goal": lambda r: "yes" if r["meets_goal"] else "no",
        }))
    if "bytes" in results:
        print(timing.markdown_table(results["bytes"], ["mode", "seq_len", "context"], {
            "formula fwd MiB": mib("formula_forward_bytes"), "zig-zag relayout MiB (A/C)": mib("relayout_bytes"),
            "HLO fwd MiB, in order (relayout per call)": lambda r: f"{r['forward_in_order']['ring_bytes'] / MiB:,.2f}",
            "HLO fwd MiB": lambda r: f"{r['forward']['ring_bytes'] / MiB:,.2f}",
            "HLO fwd+bwd MiB": lambda r: f"{r['forward_backward']['ring_bytes'] / MiB:,.2f}",
            "fwd ops": lambda r: ", ".join(f"{k} x{v}" for k, v in sorted(r["forward"]["ops"].items())),
            "fwd+bwd ops": lambda r: ", ".join(f"{k} x{v}" for k, v in sorted(r["forward_backward"]["ops"].items())),
        }))
    if "balance" in results:
        print(timing.markdown_table(results["balance"], ["context", "device"], {
            "zig-zag half blocks": lambda r: str(r["zigzag_blocks"]), "contiguous half blocks": lambda r: str(r["contiguous_blocks"]),
        }))
    if "exact" in results:
        print(timing.markdown_table(results["exact"], ["mode", "attention", "mesh", "seq_len", "steps"], {
            "max loss rel. error": lambda r: f"{r['max_loss_rel_error']:.1e}",
            "max grad rel. error (step 1)": lambda r: f"{r['max_grad_rel_error']:.1e}",
            "within 1e-5": lambda r: "yes" if r["loss_ok"] else "NO",
            "s": lambda r: f"{r['seconds']:.0f}",
        }))


def main(argv: list[str]) -> None:
    del argv
    cli.quiet_logging(flags.FLAGS.verbose)
    f = flags.FLAGS
    cli.require_counts("bytes_seq_len", "bytes_batch", "exact_seq_len", "exact_steps", "exact_batch")
    sections = [s.strip() for s in f.sections.split(",") if s.strip()]
    modes = [m.strip() for m in f.modes.split(",") if m.strip()]
    bad = [s for s in sections if s not in SECTIONS] + [m for m in modes if m not in context_attention.MODES]
    if bad:
        cli.usage_exit(f"unknown section(s) or mode(s) {bad}; --sections from {', '.join(SECTIONS)}, --modes from {', '.join(context_attention.MODES)}")
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        if "memory" in sections:
            results["memory"] = memory(modes, [int(n) for n in f.seq_lens], f.context)
        if "bytes" in sections:
            results["bytes"] = wire_bytes(modes, f.bytes_seq_len, f.context, f.bytes_batch)
        if "balance" in sections:
            results["balance"] = balance(f.context)
        if "exact" in sections:
            meshes = [m.strip() for m in f.exact_meshes.split(";") if m.strip()]
            results["exact"] = exactness(modes, meshes, f.exact_seq_len, f.exact_steps, f.exact_batch, f.exact_attention)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    print_tables(results)
    if f.json_out:
        Path(f.json_out).write_text(json.dumps(results, indent=2))


def define_flags() -> None:
    flags.DEFINE_string("sections", "memory,bytes,balance", f"Comma-separated sections: {', '.join(SECTIONS)}.")
    flags.DEFINE_string("modes", ",".join(context_attention.MODES), "Comma-separated context-parallel modes.")
    flags.DEFINE_integer("context", 8, "Context shards for the memory and bytes sections (mesh context:C).")
    cli.define_int_list_flag("seq_lens", [1024, 2048, 4096], "Sequence lengths of the memory section.")
    flags.DEFINE_integer("bytes_seq_len", 2048, "Sequence length of the bytes section.")
    flags.DEFINE_integer("bytes_batch", 1, "Batch of the bytes section.")
    flags.DEFINE_string("exact_meshes", "context:4,data:2;context:8;context:2,fsdp:2,tensor:2", "Semicolon-separated meshes of the exactness check.")
    flags.DEFINE_integer("exact_seq_len", 2048, "Sequence length of the exactness check.")
    flags.DEFINE_integer("exact_steps", 5, "Train steps of the exactness check.")
    flags.DEFINE_integer("exact_batch", 2, "Global batch (sequences) of the exactness check.")
    flags.DEFINE_string("exact_attention", "xla", "model.attention on the context meshes of the exactness check (pallas: interpret mode on CPU).")
    cli.define_cpu_devices_flag(8)
    flags.declare_key_flag("cpu_devices")
    cli.define_output_file_flag("json_out", "Write the results here as JSON.")
    cli.define_verbose_flag()


if __name__ == "__main__":
    define_flags()

    def _main(argv):
        cli.split_cpu_devices()
        main(argv)

    app.run(_main, flags_parser=cli.parse_flags)
