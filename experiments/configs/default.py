"""Default run: the `tiny` model with AdamW on the standard-library corpus, on whatever devices exist.

    python -m experiments.train --config=experiments/configs/default.py --config.steps=400
"""

import ml_collections
from ml_collections import config_dict

from experiments.configs import blocks
from lm import config as model_config
from lm import pipeline
from optim import registry, spec


def optimizer_config(name: str = "adamw", learning_rate: float | None = None) -> ml_collections.ConfigDict:
    """Common optimizer keys plus one sub-block of family keys per registered optimizer (from its spec)."""
    opt = ml_collections.ConfigDict()
    opt.name = name
    # None: the optimizer's own default (its spec in optim/), so changing the name changes it too.
    opt.learning_rate = config_dict.placeholder(float) if learning_rate is None else learning_rate
    opt.schedule = "cosine"  # constant | cosine | linear | wsd
    opt.warmup_steps = 20
    opt.min_lr_ratio = 0.1
    opt.decay_fraction = 0.2  # wsd only: fraction of the run spent decaying
    opt.weight_decay = config_dict.placeholder(float)  # None: the optimizer's own default
    opt.grad_clip_norm = 1.0
    opt.cautious = False  # mask update entries that disagree in sign with the gradient
    opt.state_bits = 0  # optimizer state in 8 or 4 bits; 0: fp32
    opt.state_kernel = "auto"  # quantized step: auto, xla, or pallas (the fused kernel; AdamW, Lion)
    for family, cls in sorted(registry.OPTIMIZERS.items()):
        opt[family] = blocks.dataclass_block(cls, spec.config_defaults(cls))
    return opt


def model_block(preset: str = "tiny") -> ml_collections.ConfigDict:
    """``preset`` and every `lm.config.ModelConfig` field (lm/config.py documents them); None keeps the preset's value."""
    set_by_presets = {key for values in model_config.PRESETS.values() for key in values}
    block = blocks.dataclass_block(model_config.ModelConfig, placeholders=set_by_presets)
    block.preset = preset
    return block


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.steps = 200
    config.batch_size = 16  # global batch, sequences
    config.grad_accum_steps = 1  # micro-batches per step; batch_size must divide by it

    config.model = model_block()
    # A local transformers checkpoint (Llama, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V2; lm/hf.py) to start from: its config.json
    # sets the architecture, config.model only how it computes. Empty: a fresh initialisation.
    config.init_from_hf = ""

    config.data = ml_collections.ConfigDict()
    config.data.path = ""  # empty: the Python standard-library corpus; else a text file or folder
    config.data.seq_len = 128
    config.data.val_fraction = 0.02
    config.data.cache_dir = ""  # empty: ~/.cache/spmdlab
    # Pre-tokenized shards instead (llm.c .bin or .npy; globs, comma-separated): e.g. "data/x/train_*.bin".
    config.data.train_files = ""
    config.data.val_files = ""
    config.data.mixture = ""  # instead of train_files: "GLOB_A:0.7,GLOB_B:0.3" samples sources by weight
    config.data.val_tokens = 0  # fixed validation set of this many tokens (e.g. 10485760); 0: eval_batches batches
    config.data.bos_aligned = False  # every sequence starts at a document start (a separator token)
    config.data.document_mask = False  # attention stays inside documents (segment ids from the separator)
    config.data.separator_id = config_dict.placeholder(int)  # None: the manifest's (EOS for the byte corpus)

    config.loss = ml_collections.ConfigDict()
    config.loss.z_loss = 0.0

    # Expert balancing of an MoE model (lm.moe.Balancing); ignored by dense models.
    config.moe = ml_collections.ConfigDict()
    config.moe.balance_loss = 0.01  # weight of the Switch load-balancing loss
    config.moe.router_z_loss = 0.001
    config.moe.balance_scope = "global"  # global (whole batch, arXiv:2501.11873) | micro_batch (per sequence)
    config.moe.bias_rate = 0.0  # auxiliary-loss-free bias step (DeepSeek-V3: 0.001); 0: off

    config.optimizer = optimizer_config()

    config.mesh = ""  # empty: every device on the data axis; e.g. "data:2,fsdp:2,tensor:2", "fsdp:-1"
    config.devices = 0  # 0: all devices; N: the first N (single process), e.g. 1 to debug on one GPU
    config.rules = "fsdp"  # logical-to-mesh rule preset: dp | fsdp | tp | sp (sharding/rules.py)
    config.rule_overrides = ""  # e.g. "mlp=tensor,params.vocab=" (logical=mesh_axis[+mesh_axis])
    # A mesh axis (e.g. "data") whose slices are replicas that each keep their own gradients and state
    # (replica-local step, for DeMo / DiLoCo / PowerSGD); empty: gradients averaged by GSPMD.
    config.replicas = ""
    # Pipeline schedule over a "stage" mesh axis (lm/pipeline.py): schedule gpipe | circular | 1f1b | zb_h1, microbatches, repeats.
    config.pipeline = blocks.dataclass_block(pipeline.Pipeline)

    config.eval_every = 100
    config.eval_batches = 8
    config.log_every = 10
    config.checkpoint_every = 100
    config.keep_checkpoints = 2
    config.max_bad_steps = 5  # consecutive non-finite steps before the run stops
    config.profile = ""  # "START:STOP": trace those steps into the workdir (experiments/profile_summary.py)
    return config
