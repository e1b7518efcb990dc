"""One training case of the benchmarks (`bench_throughput`, `bench_optimizer_step`, `bench_cpu_peer`): its config
from a preset, a batch shape, a dtype and a mesh, and its real jitted training step on random tokens."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from experiments import cli, run_spec, train_lib
from experiments.configs import default
from sharding import mesh as mesh_lib
from sharding import partition


def parse_batch_shape(text: str) -> tuple[int, int]:
    """``"8x128"`` -> ``(8, 128)``: sequences per step and tokens per sequence."""
    batch, sep, seq = text.strip().partition("x")
    if not sep or not batch.isdigit() or not seq.isdigit() or int(batch) < 1 or int(seq) < 1:
        raise cli.UsageError(f"batch shape {text!r} is not BATCHxSEQ_LEN, e.g. 8x128")
    return int(batch), int(seq)


def case_config(
    preset: str,
    batch: int,
    seq_len: int,
    dtype: str,
    mesh: str,
    optimizer: str,
    rules: str,
    base: ml_collections.ConfigDict | None = None,
) -> ml_collections.ConfigDict:
    """The training config of one case (``base`` or the default for every other key); a mesh with no -1
    runs on the first devices it needs."""
    config = copy.deepcopy(base) if base is not None else default.get_config()
    config.model.preset = preset
    config.model.dtype = dtype
    config.batch_size = batch
    config.data.seq_len = seq_len
    config.mesh = mesh
    sizes = [n for _, n in mesh_lib.parse_mesh_spec(mesh)]
    config.devices = 0 if -1 in sizes else math.prod(sizes)  # a smaller mesh takes the first devices
    config.rules = rules
    config.optimizer.name = optimizer
    return config


class TrainSteps(NamedTuple):
    """A compiled training run on random tokens: ``run(n)`` takes ``n`` more steps and returns their seconds."""

    spec: run_spec.RunSpec
    run: Callable[[int], float]


TOKEN_DISTRIBUTIONS = ("uniform", "zipf")


def random_tokens(vocab_size: int, shape: tuple[int, ...], distribution: str = "uniform", seed: int = 0) -> np.ndarray:
    """Token ids of ``shape``: ``uniform`` over the vocabulary, or ``zipf`` (id ``k`` with probability
    proportional to ``1 / (k + 1)``, as words in text: the most frequent is ~8% of GPT-2-vocabulary tokens),
    whose repeated ids make the embedding's backward pass add many rows into one, as real data does."""
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        return rng.integers(0, vocab_size, shape, dtype=np.int32)
    if distribution == "zipf":
        weights = 1.0 / np.arange(1, vocab_size + 1)
        return rng.choice(vocab_size, size=shape, p=weights / weights.sum()).astype(np.int32)
    raise ValueError(f"token distribution {distribution!r} is not one of {TOKEN_DISTRIBUTIONS}")


def compile_train_steps(config: ml_collections.ConfigDict, seed: int = 0, tokens: str = "uniform") -> TrainSteps:
    """The real jitted training step of ``config`` on one fixed batch of `random_tokens` (``tokens``: their distribution).

    The state is carried (and donated) from call to call, so consecutive steps count up like a
    training run's (what Shampoo's and SOAP's refresh schedules key on). Compilation happens in
    the first call.
    """
    spec = run_spec.build_run(config)
    shardings = spec.shardings
    rows = random_tokens(spec.cfg.vocab_size, (config.batch_size, config.data.seq_len + 1), tokens, seed)
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        carried = [train_lib.init_state(spec.model_def, spec.tx, seed, shardings)]
        step = train_lib.jit_train_step(train_lib.make_train_step(spec.model_def, spec.tx), shardings)
        batch = train_lib.global_batch(rows, shardings)

    def run(n: int) -> float:
        with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
            start = time.perf_counter()
            state = carried.pop()
            for _ in range(n):
                state, _ = step(state, batch)
            carried.append(jax.block_until_ready(state))
            return time.perf_counter() - start

    return TrainSteps(spec, run)
