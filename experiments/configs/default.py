"""Default run: the `tiny` model with AdamW on the standard-library corpus, on whatever devices exist.

    python -m experiments.train --config=experiments/configs/default.py --config.steps=400
    python -m experiments.train --config=experiments/configs/default.py:muon   # Muon; only its block

The argument after ``:`` names the optimizer and materialises only its ``optimizer.<name>`` block
(and a wrapper's inner optimizer's); without it every registered optimizer has its block, so
``--config.optimizer.name=X --config.optimizer.X.<key>=...`` works too. A run's ``config.json`` keeps
only the blocks it reads either way (`experiments.run_spec.resolve`).
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import blocks
from lm import config as model_config
from lm.data import input_pipeline
from optim import registry, run_wrappers, schedules, spec


def optimizer_config(name: str = "adamw", learning_rate: float | None = None, *, only: bool = False) -> ml_collections.ConfigDict:
    """Common optimizer keys plus one sub-block of family keys per registered optimizer (from its spec);
    with ``only``, just the blocks of ``name`` and, for a wrapper, of its default inner optimizer."""
    opt = ml_collections.ConfigDict()
    opt.name = name  # a registered optimizer (optim/registry.py); its block below holds its own keys
    # None: the optimizer's own default (its spec in optim/), so changing the name changes it too.
    opt.learning_rate = config_dict.placeholder(float) if learning_rate is None else learning_rate
    opt.schedule = "cosine"  # constant | cosine | linear | wsd
    opt.warmup_steps = config_dict.placeholder(int)  # None: min(20, steps // 10) (optim.schedules.default_warmup)
    opt.min_lr_ratio = schedules.DEFAULT_MIN_LR_RATIO  # the schedule ends at this fraction of the peak (not constant's)
    opt.decay_fraction = schedules.DEFAULT_DECAY_FRACTION  # wsd only: fraction of the run spent decaying
    opt.weight_decay = config_dict.placeholder(float)  # None: the optimizer's own default
    opt.grad_clip_norm = 1.0  # clip the gradient to this global norm; 0: no clipping
    opt.cautious = False  # mask update entries that disagree in sign with the gradient
    opt.state_bits = 0  # optimizer state in 8 or 4 bits; 0: fp32
    opt.state_kernel = "auto"  # quantized step: auto, xla, or pallas (the fused kernel; AdamW, Lion)
    # modded-nanogpt's optimizer-track wrappers, for any optimizer (optim/run_wrappers.py); all off here
    opt.cautious_weight_decay = 0.0  # decay only where update and weight agree in sign; replaces weight_decay
    opt.lookahead = ml_collections.ConfigDict(run_wrappers.LOOKAHEAD)  # EMA-Nesterov; stepsize 0: off
    opt.tail_average = ml_collections.ConfigDict(run_wrappers.TAIL_AVERAGE)  # eval/export weights; start 0: off
    if name not in registry.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; registered: {', '.join(sorted(registry.OPTIMIZERS))}")
    wanted = {name, getattr(registry.OPTIMIZERS[name], "default_inner", name)} if only else registry.OPTIMIZERS
    for family, cls in sorted(registry.OPTIMIZERS.items()):
        if family in wanted:
            opt[family] = blocks.dataclass_block(cls, spec.config_defaults(cls))
    return opt


def model_block(preset: str = model_config.DEFAULT_PRESET) -> ml_collections.ConfigDict:
    """``preset`` and every `lm.config.ModelConfig` field (lm/config.py documents them); None keeps the preset's value."""
    set_by_presets = {key for values in model_config.PRESETS.values() for key in values}
    block = blocks.dataclass_block(model_config.ModelConfig, placeholders=set_by_presets)
    block.preset = preset
    return block


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The default run; ``arg`` (``--config=default.py:muon``) names the optimizer and keeps only its block."""
    config = ml_collections.ConfigDict()
    config.seed = 0  # parameter initialisation and data order
    config.steps = 200  # optimizer steps of the run (the schedule's length)
    config.batch_size = 16  # global batch, sequences
    config.grad_accum_steps = 1  # micro-batches per step; batch_size must divide by it

    config.model = model_block()
    # A local transformers checkpoint (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V2; lm/hf.py) to start from: its config.json
    # sets the architecture, config.model only how it computes. Empty: a fresh initialisation.
    config.init_from_hf = ""

    # What the run reads: every `lm.data.input_pipeline.DataConfig` field (lm/data/input_pipeline.py documents them).
    config.data = blocks.dataclass_block(input_pipeline.DataConfig)

    config.loss = ml_collections.ConfigDict()
    config.loss.z_loss = 0.0  # weight of the softmax normaliser's squared log (PaLM's z-loss); 0: off

    # Expert balancing of an MoE model (lm.moe.Balancing); ignored by dense models.
    config.moe = ml_collections.ConfigDict()
    config.moe.balance_loss = 0.01  # weight of the Switch load-balancing loss
    config.moe.router_z_loss = 0.001  # weight of the router logits' z-loss (ST-MoE)
    config.moe.balance_scope = "global"  # global (whole batch, arXiv:2501.11873) | micro_batch (per sequence)
    config.moe.bias_rate = 0.0  # auxiliary-loss-free bias step (DeepSeek-V3: 0.001); 0: off

    config.optimizer = optimizer_config(arg or "adamw", only=bool(arg))

    config.mesh = ""  # empty: every device on the data axis; e.g. "data:2,fsdp:2,tensor:2", "fsdp:-1"
    config.devices = 0  # 0: all devices; N: the first N (single process), e.g. 1 to debug on one GPU
    config.rules = "fsdp"  # logical-to-mesh rule preset: dp | fsdp | tp | sp (sharding/rules.py)
    config.rule_overrides = ""  # e.g. "mlp=tensor,params.vocab=" (logical=mesh_axis[+mesh_axis])
    # A mesh axis (e.g. "data") whose slices are replicas that each keep their own gradients and state
    # (replica-local step, for DeMo / DiLoCo / PowerSGD); empty: gradients averaged by GSPMD.
    config.replicas = ""

    # Weights & Biases (pip install -e '.[wandb]'): records, config and summary mirrored to a W&B run.
    config.wandb = ml_collections.ConfigDict()
    config.wandb.project = ""  # empty: off; else the W&B project of the run
    config.wandb.mode = "online"  # online | offline (synced later with `wandb sync`) | disabled

    config.eval_every = 100  # steps between validation losses (and at the last step)
    config.eval_batches = 8  # validation batches (when data.val_tokens is 0)
    config.log_every = 10  # steps between metrics.jsonl / TensorBoard records
    config.checkpoint_every = 100  # steps between checkpoints (and at the last step)
    config.keep_checkpoints = 2  # newest checkpoints kept
    config.max_bad_steps = 5  # consecutive non-finite steps before the run stops
    config.profile = ""  # "START:STOP": trace those steps into the workdir (experiments/profiling.py, experiments/profile_summary.py)
    return config
