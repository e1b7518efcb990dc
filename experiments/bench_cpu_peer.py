r"""Our training step against the same decoder in PyTorch, timed interleaved in one process, on any device.

    pip install torch --index-url https://download.pytorch.org/whl/cpu   # optional: `pip install -e .[bench]`
    python -m experiments.bench_cpu_peer --json_out=/tmp/cpu_peer.json
    python -m experiments.bench_cpu_peer --presets=gpt2-124m --batch_shapes=16x1024 --sweep_batches= --products=false  # a GPU

``--device``: ``auto`` (CUDA where PyTorch and JAX both see a GPU, else the CPU), ``cpu`` or ``cuda``. On a CPU
both sides run float32, the twin in eager mode (what a CPU user runs). On CUDA both run the README's GPU
recipe: ours at ``--dtype`` (default bfloat16 parameters and activations, `attention=auto`), the twin under
``torch.autocast`` to bfloat16 with its loss `torch.compile`d, fused AdamW, and the non-finite check on the
device (the fused optimizer's ``found_inf``, as `torch.amp.GradScaler` sets it) rather than a host sync.

The twin is written here with `torch.nn.functional` on the weights of our model, copied from our
initial parameters (`twin_weights`): RMSNorm (`F.rms_norm`), rotate-half RoPE, causal grouped-query
attention (`F.scaled_dot_product_attention(..., enable_gqa=True)`: no repeated keys or values),
SwiGLU, tied embeddings, mean next-token cross-entropy. Before timing, each preset is checked: the
twin's parameter count equals ours and its loss on a batch equals ours within ``--loss_rtol``.

A training step is, on both sides, forward, backward, global-norm clipping to 1, a non-finite check
and AdamW (betas 0.9 / 0.95, decay 0.1 on matrices; ours is `experiments.train`'s real jitted step,
`experiments.train_steps.compile_train_steps`; the twin's `torch.optim.AdamW` at PyTorch's
defaults otherwise). The machine may be shared, so the two are timed in turn, in one process:
``--repeats`` samples of ``--steps`` steps each, ours and the twin's alternating (the first to run
alternates too), and the table gives each side's median tokens/s and the median of the per-sample
ratios ours / twin's, which a load that changes slowly cancels out of.

``--products`` then times the step's matrix products alone, the same way: every linear layer's
weight shape ``(in, out)`` on the step's ``batch x seq`` rows, in the three forms a training step
computes (forward ``x W``, input gradient ``g W^T``, weight gradient ``x^T g``), as one jitted
``jnp`` product on our side and one ``torch`` product on the twin's, with the step's FLOP-weighted
total: how fast each side's matrix multiply is at the model's shapes, apart from everything else.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import app, flags

from experiments import cli, host_memory, run_spec, train_lib, train_steps
from lm import config as model_config_lib
from lm import model as model_lib
from optim import build
from sharding import partition

TORCH_MISSING = (
    "PyTorch is not installed; install the CPU wheel: pip install torch --index-url https://download.pytorch.org/whl/cpu"
)
DEVICES = ("auto", "cpu", "cuda")


def check_twinnable(cfg: model_config_lib.ModelConfig) -> None:
    """Raises a `cli.UsageError` naming the field when the twin cannot mirror ``cfg`` (it is the dense GQA decoder)."""
    unsupported = {
        "attention_type": cfg.attention_type != "gqa",
        "n_experts": cfg.n_experts > 0,
        "qk_norm": cfg.qk_norm,
        "tie_embeddings": not cfg.tie_embeddings,
        "document_separator": cfg.document_separator is not None,
        "rope_scaling": cfg.rope_scaling != "none",
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise cli.UsageError(
            f"the PyTorch twin mirrors the dense grouped-query decoder with tied embeddings; reset model.{', model.'.join(bad)}"
        )


def twin_weights(params: model_lib.Params, cfg: model_config_lib.ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters as the twin's named float32 weights: PyTorch's ``(out, in)`` matrices, one entry per layer."""
    check_twinnable(cfg)
    params = jax.device_get(params)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731  (bf16 parameters: the twin keeps fp32 weights under autocast)
    out = {"embed": f32(params["embed"]["embedding"]), "final_norm": f32(params["final_norm"]["scale"])}
    blocks = params["blocks"]
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda a: a[i], blocks) if cfg.scan_layers else blocks[i]  # noqa: B023
        out[f"{i}.attn_norm"] = f32(layer["attn_norm"]["scale"])
        out[f"{i}.mlp_norm"] = f32(layer["mlp_norm"]["scale"])
        for group, names in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                out[f"{i}.{name}"] = np.ascontiguousarray(f32(layer[group][name]["kernel"]).T)
    return out


def twin_loss(torch: Any, weights: dict[str, Any], tokens: Any, cfg: model_config_lib.ModelConfig) -> Any:
    """Mean next-token cross-entropy of the twin on ``tokens`` ``(batch, seq + 1)`` (int64 tensor)."""
    functional = torch.nn.functional
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    half = cfg.head_dim // 2
    freqs = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=tokens.device) / half)
    angles = torch.arange(t, dtype=torch.float32, device=tokens.device)[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()

    def rope(x):  # (batch, heads, seq, head_dim), pairs (i, i + d/2)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def norm(x, name):
        return functional.rms_norm(x, (cfg.d_model,), weights[name], cfg.norm_eps)

    def heads(x, n):
        return x.view(b, t, n, cfg.head_dim).transpose(1, 2)

    x = weights["embed"][inputs]
    for i in range(cfg.n_layers):
        w = lambda name: weights[f"{i}.{name}"]  # noqa: E731, B023
        h = norm(x, f"{i}.attn_norm")
        q = rope(heads(functional.linear(h, w("q_proj")), cfg.n_heads))
        k = rope(heads(functional.linear(h, w("k_proj")), cfg.n_kv_heads))
        v = heads(functional.linear(h, w("v_proj")), cfg.n_kv_heads)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        x = x + functional.linear(attended.transpose(1, 2).reshape(b, t, -1), w("o_proj"))
        h = norm(x, f"{i}.mlp_norm")
        x = x + functional.linear(functional.silu(functional.linear(h, w("gate_proj"))) * functional.linear(h, w("up_proj")), w("down_proj"))
    logits = functional.linear(norm(x, "final_norm"), weights["embed"])
    return functional.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise cli.UsageError(TORCH_MISSING) from e
    return torch


def resolve_device(device: str) -> str:
    """``cpu`` or ``cuda`` for ``--device`` (``auto``: CUDA where PyTorch and JAX both have a GPU)."""
    if device not in DEVICES:
        raise cli.UsageError(f"--device={device} is not one of {', '.join(DEVICES)}")
    torch = _import_torch()
    jax_gpu = jax.default_backend() in ("gpu", "cuda")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and jax_gpu else "cpu"
    if device == "cuda" and not (torch.cuda.is_available() and jax_gpu):
        raise cli.UsageError(
            f"--device=cuda needs a GPU that PyTorch (cuda available: {torch.cuda.is_available()}) and JAX "
            f"(backend {jax.default_backend()}) both see; use --device=cpu"
        )
    return device


def twin_step(
    cfg: model_config_lib.ModelConfig, params: model_lib.Params, rows: np.ndarray, learning_rate: float, device: str = "cpu"
) -> Callable[[int], float]:
    """``run(n)``: ``n`` twin training steps on ``rows``, returning their seconds (module docstring)."""
    torch = _import_torch()
    cuda = device == "cuda"
    weights = {k: torch.from_numpy(v.copy()).to(device).requires_grad_() for k, v in twin_weights(params, cfg).items()}
    matrices = [w for w in weights.values() if w.ndim == 2]
    vectors = [w for w in weights.values() if w.ndim != 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=cuda,
    )  # fmt: skip
    tokens = torch.from_numpy(rows.astype(np.int64)).to(device)
    parameters = list(weights.values())
    compiled = torch.compile(functools.partial(twin_loss, torch, cfg=cfg)) if cuda else None

    def loss() -> Any:
        if not cuda:
            return twin_loss(torch, weights, tokens, cfg)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return compiled(weights, tokens)

    def run(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            loss().backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            if cuda:  # skipped on the device by the fused step, no host sync (torch.amp.GradScaler's mechanism)
                optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
                optimizer.step()
            elif torch.isfinite(grad_norm):
                optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return run


def check_twin(model_def: model_lib.ModelDef, params: model_lib.Params, rows: np.ndarray) -> dict[str, float]:
    """Our and the twin's parameter counts and loss on ``rows`` ``(batch, seq + 1)`` with the same weights."""
    torch = _import_torch()
    cfg = model_def.config
    with jax.default_matmul_precision("highest"):  # IEEE float32 on a GPU too (its default is TF32), as the twin on a CPU
        ours = float(jax.jit(train_lib.make_eval_step(model_def))(params, rows))
    weights = {k: torch.from_numpy(v.copy()) for k, v in twin_weights(params, cfg).items()}
    with torch.no_grad():
        twin = float(twin_loss(torch, weights, torch.from_numpy(rows.astype(np.int64)), cfg))
    return {
        "params": model_lib.count_params(model_def).total,
        "twin_params": sum(w.numel() for w in weights.values()),
        "loss": ours,
        "twin_loss": twin,
    }


def in_turn(runs: tuple[Callable[[int], float], Callable[[int], float]], repeats: int, calls: int) -> tuple[list[float], list[float]]:
    """``repeats`` samples of each side's seconds per call, ``runs[i](calls)`` returning the seconds of
    ``calls`` calls; the sides alternate, and so does which one goes first."""
    seconds: tuple[list[float], list[float]] = ([], [])
    for r in range(repeats):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            seconds[side].append(runs[side](calls) / calls)
    return seconds


def _case(
    preset: str, batch: int, seq_len: int, base: Any, *, warmup: int, repeats: int, steps: int, seed: int, device: str = "cpu", dtype: str = "float32"
) -> dict[str, Any]:
    config = train_steps.case_config(preset, batch, seq_len, dtype, "", "adamw", "fsdp", base=base)
    config.optimizer.schedule = "constant"
    ours = train_steps.compile_train_steps(config, seed)
    spec = ours.spec
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        params = model_lib.init_params(spec.model_def, seed, spec.shardings.params)
    rows = np.random.default_rng(seed).integers(0, spec.cfg.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    twin = twin_step(spec.cfg, params, rows, float(build.learning_rate_fn(config.optimizer, config.steps)(0)), device)
    for run in (ours.run, twin):
        run(warmup)
    seconds = in_turn((ours.run, twin), repeats, steps)
    tokens = batch * seq_len
    rates = [[tokens / s for s in side] for side in seconds]
    return {
        "preset": preset,
        "batch_size": batch,
        "seq_len": seq_len,
        "device": device,
        "dtype": dtype,
        "tokens_per_second": statistics.median(rates[0]),
        "twin_tokens_per_second": statistics.median(rates[1]),
        "ratio": statistics.median(a / b for a, b in zip(*rates, strict=True)),
        "tokens_per_second_samples": rates[0],
        "twin_tokens_per_second_samples": rates[1],
    }


# The three products of a linear layer ``y = x W`` in a training step, as functions of ``(x, W, g)``.
PRODUCT_FORMS = {
    "x W": lambda x, w, g: x @ w,
    "g W^T": lambda x, w, g: g @ w.T,
    "x^T g": lambda x, w, g: x.T @ g,
}


def layer_shapes(cfg: model_config_lib.ModelConfig) -> dict[tuple[int, int], int]:
    """The weight shapes ``(in, out)`` of a step's linear layers and how many of each it multiplies
    (per block: query, key, value, output, gate, up and down projections; once: the tied head)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_block = [(cfg.d_model, q), (cfg.d_model, kv), (cfg.d_model, kv), (q, cfg.d_model), (cfg.d_model, cfg.mlp_dim), (cfg.d_model, cfg.mlp_dim), (cfg.mlp_dim, cfg.d_model)]
    counts: dict[tuple[int, int], int] = {}
    for shape in per_block:
        counts[shape] = counts.get(shape, 0) + cfg.n_layers
    counts[(cfg.d_model, cfg.vocab_size)] = counts.get((cfg.d_model, cfg.vocab_size), 0) + 1
    return counts


def _time_calls(call: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - start


def _products(
    torch: Any, preset: str, batch: int, seq_len: int, *, repeats: int, calls: int = 5, device: str = "cpu", dtype: str = "float32"
) -> dict[str, Any]:
    """Both sides' products at ``preset``'s layer shapes on ``batch * seq_len`` rows in ``dtype``, timed in turn."""
    rng = np.random.default_rng(0)
    rows = batch * seq_len
    results, ours_total, twin_total = [], 0.0, 0.0
    for (n_in, n_out), count in layer_shapes(model_config_lib.from_preset(preset)).items():
        arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in ((rows, n_in), (n_in, n_out), (rows, n_out))]
        ours_args = [jax.device_put(a.astype(dtype)) for a in arrays]
        twin_args = [torch.from_numpy(a).to(device, getattr(torch, dtype)) for a in arrays]
        sync = torch.cuda.synchronize if device == "cuda" else lambda: None
        for form, product in PRODUCT_FORMS.items():
            ours_fn = jax.jit(product)
            runs = (
                functools.partial(_time_calls, lambda f=ours_fn, a=ours_args: f(*a).block_until_ready()),
                functools.partial(_time_calls, lambda f=product, a=twin_args: (f(*a), sync())),
            )
            for run in runs:  # warm-up, compilation included
                run(1)
            seconds = in_turn(runs, repeats, calls)
            flops = 2 * rows * n_in * n_out
            ours_s, twin_s = statistics.median(seconds[0]), statistics.median(seconds[1])
            ours_total, twin_total = ours_total + count * ours_s, twin_total + count * twin_s
            results.append({"shape": [n_in, n_out], "form": form, "count": count, "gflops": flops / ours_s / 1e9, "twin_gflops": flops / twin_s / 1e9})
    return {"preset": preset, "rows": rows, "products": results, "ratio": twin_total / ours_total}


def format_products(cases: list[dict[str, Any]]) -> str:
    lines = ["| preset | weight (in, out) x per step | product | ours GFLOP/s | PyTorch GFLOP/s | ours / PyTorch |", "|---|---|---|---|---|---|"]
    for c in cases:
        for p in c["products"]:
            lines.append(
                f"| {c['preset']} | ({p['shape'][0]}, {p['shape'][1]}) x {p['count']} | {p['form']} | {p['gflops']:.0f} "
                f"| {p['twin_gflops']:.0f} | {p['gflops'] / p['twin_gflops']:.2f}x |"
            )
        lines.append(f"| {c['preset']} | all, weighted by time | | | | **{c['ratio']:.2f}x** |")
    return "\n".join(lines)


def format_table(cases: list[dict[str, Any]]) -> str:
    lines = [
        "| preset | batch x seq | ours tokens/s | PyTorch tokens/s (eager on a CPU, compiled bf16 on CUDA) | ours / PyTorch (median of samples) |",
        "|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c['preset']} | {c['batch_size']}x{c['seq_len']} | {c['tokens_per_second']:,.0f} "
            f"| {c['twin_tokens_per_second']:,.0f} | {c['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv  # checked by cli.parse_flags
    f = flags.FLAGS
    host_memory.keep_freed_memory()  # before JAX starts its backend
    cli.quiet_logging(f.verbose)
    try:
        torch = _import_torch()
        device = resolve_device(f.device)
        dtype = f.dtype or ("bfloat16" if device == "cuda" else "float32")
        if dtype not in ("float32", "bfloat16"):
            raise cli.UsageError(f"--dtype={dtype} is not float32 or bfloat16")
        cli.check_counts("warmup", "repeats", "steps")
        shapes = [train_steps.parse_batch_shape(s) for s in f.batch_shapes]
        cases = [(p, b, t) for p in f.presets for b, t in shapes]
        cases += [(f.presets[0], int(b), shapes[0][1]) for b in f.sweep_batches if (f.presets[0], int(b), shapes[0][1]) not in cases]
        for preset in dict.fromkeys(p for p, _, _ in cases):
            check_twinnable(model_config_lib.from_preset(preset))
    except (cli.UsageError, ValueError) as e:
        if f.verbose:
            raise
        cli.usage_exit(str(e))
    checks = {}
    for preset, _, seq_len in cases:
        if preset not in checks:
            config = train_steps.case_config(preset, 4, seq_len, "float32", "", "adamw", "fsdp", base=config_flag.value)
            model_def = run_spec.build_run(config).model_def
            rows = np.random.default_rng(f.seed + 1).integers(0, model_def.config.vocab_size, (4, seq_len + 1), dtype=np.int32)
            checks[preset] = check_twin(model_def, model_lib.init_params(model_def, f.seed), rows)
            c = checks[preset]
            if c["params"] != c["twin_params"] or abs(c["loss"] - c["twin_loss"]) > f.loss_rtol * abs(c["loss"]):
                sys.exit(f"error: the PyTorch twin of {preset} differs from ours: {c}")
    results = []
    for i, (preset, batch, seq_len) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {preset} {batch}x{seq_len}", file=sys.stderr, flush=True)
        results.append(
            {
                **_case(preset, batch, seq_len, config_flag.value, warmup=f.warmup, repeats=f.repeats, steps=f.steps, seed=f.seed, device=device, dtype=dtype),
                **checks[preset],
            }
        )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"
    if device == "cuda":
        machine = f"{torch.cuda.get_device_name()}; {machine}"
    print(f"{datetime.date.today()}: {machine}; jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    for preset, c in checks.items():
        print(f"{preset}: {c['params']:,} parameters on both sides; loss {c['loss']:.6f} ours, {c['twin_loss']:.6f} PyTorch's")
    print(format_table(results))
    products = []
    if f.products:
        for preset in dict.fromkeys(p for p, _, _ in cases):
            print(f"products: {preset}", file=sys.stderr, flush=True)
            products.append(_products(torch, preset, *shapes[0], repeats=f.repeats, device=device, dtype=dtype))
        print(format_products(products))
    if f.json_out:
        header = {"date": str(datetime.date.today()), "machine": machine, "jax": jax.__version__, "torch": torch.__version__, "device": device}
        with open(f.json_out, "w") as out:
            json.dump({**header, "torch_threads": torch.get_num_threads(), "cases": results, "products": products}, out, indent=1)


def define_flags() -> flags.FlagHolder:
    """The benchmark's flags, and ``--config`` whose ``--config.<key>`` overrides apply to our side of every case."""
    flags.DEFINE_list("presets", ["tiny", "small"], "Model presets (lm/config.py).")
    flags.DEFINE_list("batch_shapes", ["16x256"], "BATCHxSEQ_LEN shapes, for every preset.")
    cli.define_int_list_flag("sweep_batches", [8, 32], "More batch sizes for the first preset, at the first shape's length.", allow_empty=True)
    flags.DEFINE_integer("warmup", 2, "Untimed steps of each side first (compilation included).")
    flags.DEFINE_integer("repeats", 5, "Timed samples per side.")
    flags.DEFINE_integer("steps", 1, "Steps per sample.")
    flags.DEFINE_integer("seed", 0, "Initialisation and batch seed.")
    flags.DEFINE_float("loss_rtol", 1e-4, "Largest relative difference of the two losses on the same weights.")
    flags.DEFINE_bool("products", True, "Also time both sides' matrix products at each preset's layer shapes (first batch shape).")
    cli.define_output_file_flag("json_out", "Also write every case as JSON here.")
    flags.DEFINE_enum("device", "auto", list(DEVICES), "Where both sides run: auto (CUDA where PyTorch and JAX see a GPU), cpu, cuda.")
    flags.DEFINE_string("dtype", None, "Our parameters and activations (float32, bfloat16); default: bfloat16 on CUDA, float32 on a CPU.")
    cli.define_verbose_flag()
    return cli.define_config_flag(cli.DEFAULT_CONFIG)


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=cli.parse_flags)
