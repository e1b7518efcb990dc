"""modded-nanogpt's GPT-2 speedrun, track 1 (record 21, 2025-01-26), as a run of this codebase.

    python -m experiments.speedrun --workdir=runs/speedrun                        # FineWeb shards in data/fineweb10B/
    python -m experiments.speedrun --config=experiments/configs/speedrun.py:tiny --workdir=runs/speedrun-tiny   # a CPU

The record: 8 GPUs x one 48 Ki-token sequence per step (393,216 tokens), documents masked at GPT-2's
end-of-text (50256), 1770 steps of Muon (lr 0.05, momentum 0.85 -> 0.95 over 300 steps, Nesterov, Jordan's shape scale)
on hidden matrices and Adam (betas 0.8, 0.95, eps 1e-10; lr 0.6 embeddings, 0.008 head, 0.04 scalars)
elsewhere (`optim.speedrun_muon`), no weight decay, no clipping, a
learning rate that is constant and then falls linearly to 0.1x over the last 40% of the steps,
validation on the first 10,485,760 tokens of the validation shards every 125 steps, target 3.28.
What differs is listed in the README ("GPT-2 speedrun").

``:tiny`` is the `speedrun-tiny` preset on byte-level shards of the standard library
(`experiments.speedrun` writes them) with a target a CPU reaches in a few minutes.
"""

import ml_collections

from experiments.configs import default

RECORD_VAL_TOKENS = 10_485_760  # modded-nanogpt's fixed validation set
RECORD_TARGET = 3.28
GPT2_EOT = 50256


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = default.get_config("speedrun_muon")
    config.target_val_loss = RECORD_TARGET  # the run stops at the first evaluation at or below it
    config.steps = 1770
    config.batch_size = 8  # sequences per step: one per GPU in the record
    config.eval_every = 125
    config.log_every = 25
    config.checkpoint_every = 10_000  # only at the end (or at the target)
    config.model.preset = "speedrun-124m"
    config.model.window_warmup = config.get_ref("steps")  # the windows grow over the whole run, as the record's
    data = config.data
    data.train_files = "data/fineweb10B/fineweb_train_*.bin"
    data.val_files = "data/fineweb10B/fineweb_val_*.bin"
    data.seq_len = 48 * 1024
    data.val_tokens = RECORD_VAL_TOKENS  # exactly: 26 whole batches of 8 x 48Ki and a last one padded and weighted
    data.document_mask = True
    data.separator_id = GPT2_EOT
    opt = config.optimizer
    opt.learning_rate = 0.05
    opt.schedule = "wsd"
    opt.warmup_steps = 0
    opt.decay_fraction = 0.4
    opt.min_lr_ratio = 0.1
    opt.weight_decay = 0.0
    opt.grad_clip_norm = 0.0
    muon = opt.speedrun_muon  # optim/speedrun_muon.py: Muon on hidden matrices, Adam in the record's three groups
    muon.shape_scale = "jordan"
    muon.beta = 0.95
    muon.nesterov = True
    muon.momentum_warmup_start, muon.momentum_warmup_steps = 0.85, 300  # momentum 0.85 -> 0.95 over 300 steps
    muon.embed_lr_ratio, muon.head_lr_ratio, muon.adam_lr_ratio = 12.0, 0.16, 0.8  # Adam 0.6, 0.008, 0.04 at lr 0.05
    muon.adam_b1, muon.adam_b2, muon.adam_eps = 0.8, 0.95, 1e-10
    if arg == "tiny":
        config.model.preset = "speedrun-tiny"
        config.target_val_loss = 2.1
        config.steps = 150
        config.batch_size = 8
        config.eval_every = 25
        config.log_every = 10
        data.train_files = data.val_files = ""  # experiments.speedrun fills them with its stdlib shards
        data.seq_len = 256
        data.val_tokens = 65_536
        data.separator_id = None  # the shards' manifest's
        opt.learning_rate = 0.02
        muon.momentum_warmup_steps = 25  # the record's 300 of 1770 steps, scaled to 150
    elif arg not in (None, "", "124m"):
        raise ValueError(f"experiments/configs/speedrun.py takes '124m' (the default) or 'tiny', not {arg!r}")
    return config
