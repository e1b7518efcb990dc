r"""Lightning attention against softmax attention: memory of the gradient and of the decode step against length,
and the op's time (forward + backward), all from compiled programs on the host's backend.

    python -m experiments.bench_lightning --json_out=/tmp/lightning.json
    python -m experiments.bench_lightning --seqs=256,1024 --decode_lens=256,1024 --iters=3   # quick

``op`` rows: ``(batch, seq, heads, head_dim)`` operands, the gradient of ``sum(sin(attention(q, k, v)))``
to q, k, v: `kernels_pallas.lightning.lightning_attention` (``--implementation``, XLA by default) and
softmax attention's XLA form (`kernels_pallas.attention.api.attention`, ``xla``); ``temp MiB`` is the
compiled program's `memory_analysis().temp_size_in_bytes`, ``per token`` that over ``batch x seq``.
``decode`` rows: one token of the ``--preset`` model (``scan_layers=False``) against a cache of
``len`` positions, lightning everywhere against grouped-query softmax attention: argument (parameters +
cache) plus temporary bytes of the compiled step.
"""

from __future__ import annotations

import datetime
import json

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import cli, timing
from kernels_pallas.attention import api as attention_api
from kernels_pallas.lightning import lightning_attention
from lm import config as config_lib
from lm import kv_cache
from lm import model as model_lib

MIB = 2**20


def define_flags() -> None:
    cli.define_int_list_flag("seqs", [256, 1024, 4096], "sequence lengths of the op rows")
    flags.DEFINE_integer("batch", 1, "batch of the op rows")
    flags.DEFINE_integer("heads", 4, "heads of the op rows")
    flags.DEFINE_integer("head_dim", 32, "head width of the op rows")
    flags.DEFINE_integer("block", 64, "lightning block size")
    flags.DEFINE_enum("implementation", "xla", ["auto", "xla", "pallas"], "lightning implementation")
    cli.define_int_list_flag("decode_lens", [256, 1024, 4096, 16384], "cache lengths of the decode rows")
    flags.DEFINE_enum("preset", "tiny", list(config_lib.PRESETS), "model preset of the decode rows")
    flags.DEFINE_integer("warmup", 1, "untimed calls first (compilation included)")
    flags.DEFINE_integer("iters", 5, "timed samples per row")
    cli.define_output_file_flag("json_out", "Write the rows here as JSON.")


def _grad_fn(attend):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), argnums=(0, 1, 2)))


def op_rows(f) -> list[dict]:
    slopes = 2.0 ** (-8.0 * (jnp.arange(f.heads) + 1) / f.heads)
    attends = {
        "lightning": lambda q, k, v: lightning_attention(q, k, v, slopes, block=f.block, implementation=f.implementation)[0],
        "softmax (xla)": lambda q, k, v: attention_api.attention(q, k, v, implementation="xla")[0],
    }
    rows = []
    for seq in map(int, f.seqs):
        shape = (f.batch, seq, f.heads, f.head_dim)
        args = [jax.random.normal(jax.random.key(i), shape) * 0.3 for i in range(3)]
        for name, attend in attends.items():
            fn = _grad_fn(attend)
            temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
            row = {"op": name, "seq": seq, "temp_mib": temp / MIB, "temp_bytes_per_token": temp / (f.batch * seq)}
            timing.timed_row(row, lambda fn=fn, args=args: fn(*args), f.warmup, f.iters)
            rows.append(row)
    return rows


def decode_rows(f) -> list[dict]:
    rows = []
    for kind in ("lightning", "gqa"):
        for length in map(int, f.decode_lens):
            cfg = config_lib.from_preset(f.preset, scan_layers=False, attention_type=kind, max_seq_len=max(length, 1))
            model_def = model_lib.define(cfg)
            cache = jax.eval_shape(lambda cfg=cfg, length=length: kv_cache.init(cfg, 1, length))
            step = jax.jit(lambda p, c, md=model_def: model_lib.decode(md, p, jnp.ones((1, 1), jnp.int32), c, jnp.int32(0)))
            analysis = step.lower(model_def.abstract_params, cache).compile().memory_analysis()
            rows.append({
                "attention": kind, "len": length,
                "argument_mib": analysis.argument_size_in_bytes / MIB, "temp_mib": analysis.temp_size_in_bytes / MIB,
            })  # fmt: skip
    return rows


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    cli.require_counts("iters", "batch", "heads", "head_dim", "block")
    ops, decodes = op_rows(f), decode_rows(f)
    print(f"{datetime.date.today()}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(timing.markdown_table(ops, ("op", "seq"), {
        "grad temp MiB": lambda r: f"{r['temp_mib']:.2f}", "per token (bytes)": lambda r: f"{r['temp_bytes_per_token']:,.0f}",
        **timing.TIME_COLUMNS,
    }))  # fmt: skip
    print()
    print(timing.markdown_table(decodes, ("attention", "len"), {
        "arguments MiB": lambda r: f"{r['argument_mib']:.2f}", "temp MiB": lambda r: f"{r['temp_mib']:.2f}",
    }))  # fmt: skip
    if f.json_out:
        with open(f.json_out, "w") as out:
            json.dump({"op": ops, "decode": decodes, "flags": {k: getattr(f, k) for k in ("seqs", "batch", "heads", "head_dim", "block", "preset")}}, out, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
