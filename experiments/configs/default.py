"""Default run: the `tiny` model with AdamW on the standard-library corpus, on whatever devices exist.

    python -m experiments.train --config=experiments/configs/default.py --config.steps=400
"""

import ml_collections
from ml_collections import config_dict

from optim import registry


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
    for family in sorted(registry.OPTIMIZERS):
        opt[family] = registry.family_defaults(family)
    return opt


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.steps = 200
    config.batch_size = 16  # global batch, sequences
    config.grad_accum_steps = 1  # micro-batches per step; batch_size must divide by it

    config.model = ml_collections.ConfigDict()
    config.model.preset = "tiny"
    # Any ModelConfig field may be set here; None keeps the preset's value.
    # vocab_size None: the manifest's (padded to a multiple of 128) with data.train_files, else the preset's.
    for size in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim"):
        config.model[size] = config_dict.placeholder(int)
    config.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    config.model.scan_layers = config_dict.placeholder(bool)  # None: the preset's (True except deepseek-v2-lite)
    config.model.scan_unroll = 1  # blocks per scan iteration
    # none | full | dots_saveable | dots_with_no_batch_dims_saveable | save_attention | dots_and_attention
    # (lm/remat.py); true = full, false = none
    config.model.remat = "none"
    config.model.qk_norm = False
    config.model.tie_embeddings = config_dict.placeholder(bool)  # None: the preset's (untied in mixtral-8x7b, deepseek-v2-lite)
    config.model.track_attn_logits = False
    config.model.attention = "auto"  # auto | xla | cudnn | pallas; auto: XLA on CPU, cuDNN else Pallas on GPU, Pallas on TPU
    # Mixture of experts (lm/moe.py), None keeps the preset's value: n_experts (0: dense),
    # experts_per_token, n_shared_experts, moe_every, first_dense_layers, expert_mlp_dim, capacity_factor (<= 0: dropless),
    # router_score (softmax | sigmoid), normalize_router_weights.
    for size in ("n_experts", "experts_per_token", "n_shared_experts", "moe_every", "first_dense_layers", "expert_mlp_dim"):
        config.model[size] = config_dict.placeholder(int)
    config.model.capacity_factor = config_dict.placeholder(float)
    config.model.router_score = config_dict.placeholder(str)
    config.model.normalize_router_weights = config_dict.placeholder(bool)
    # auto | ragged_dot | gmm: dropless grouped matmuls; auto: the Pallas gmm kernel on GPU, ragged_dot elsewhere
    config.model.moe_matmul = "auto"
    config.model.attention_type = config_dict.placeholder(str)  # gqa | mla (multi-head latent attention, lm/mla.py)
    for mla_size in ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim"):
        config.model[mla_size] = config_dict.placeholder(int)

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

    config.eval_every = 100
    config.eval_batches = 8
    config.log_every = 10
    config.checkpoint_every = 100
    config.keep_checkpoints = 2
    config.max_bad_steps = 5  # consecutive non-finite steps before the run stops
    return config
