"""Base run of `experiments/bench_comm.py`: `tiny` on 8 replicas (``data:8``), every row the same data,
batch, schedule and seed; rows change only the optimizer (and ``replicas``).

    python -m experiments.bench_comm --config=experiments/configs/bench_comm.py --config.steps=300
"""

from experiments.configs import default


def get_config():
    config = default.get_config()
    config.mesh = "data:8"
    config.steps = 300
    config.batch_size = 32  # 4 sequences per replica
    config.data.seq_len = 64
    config.eval_every = 100
    config.eval_batches = 8
    config.log_every = 50
    config.checkpoint_every = 10_000  # no checkpoints but the last
    config.optimizer.warmup_steps = 20
    return config
