"""Model configuration: a frozen dataclass and named presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from lm import fp8 as fp8_lib
from lm import remat as remat_lib
from lm import speedrun_config
from lm.data import tokenizer

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas", "tokamax")  # see lm/attention.py
CONTEXT_PARALLEL = ("all_gather", "ring", "ulysses")  # see lm/parallel/context_attention.py
ATTENTION_TYPES = ("gqa", "mla", "lightning")  # lightning: lm/lightning.py
ROPE_SCALINGS = ("none", "linear", "dynamic", "llama3", "yarn")  # see lm/rope.py
MOE_MATMULS = ("auto", "ragged_dot", "gmm", "tokamax")  # see lm/moe.py  # grouped-query (lm/attention.py) or multi-head latent (lm/mla.py)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (pre-norm, RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int = tokenizer.PADDED_VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 384
    max_seq_len: int = 1024
    rope_theta: float = 10_000.0
    # RoPE context-extension scaling (lm/rope.py); "none" keeps theta's frequencies.
    rope_scaling: str = "none"  # none | linear | dynamic | llama3 | yarn
    rope_factor: float = 1.0  # s: how much longer than the original context
    rope_original_max_len: int = 0  # L0, the pretraining context (original_max_position_embeddings); 0: max_seq_len
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above L0 / this are divided by s
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below L0 / this are kept
    rope_beta_fast: float = 32.0  # yarn: pairs turning more often than this over L0 keep their frequency
    rope_beta_slow: float = 1.0  # yarn: pairs turning less often are divided by s
    rope_mscale: float = 0.0  # yarn: attention factor m(s, mscale) / m(s, mscale_all_dim) when both are set
    rope_mscale_all_dim: float = 0.0  # yarn; with mla also the softmax scale times m(s, mscale_all_dim)^2
    rope_attention_factor: float = 0.0  # yarn: the attention factor itself; 0: from the mscales
    rope_truncate: bool = True  # yarn: round the ramp's ends to whole pairs
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qk_norm: bool = False
    dtype: str = "float32"  # compute dtype; parameters are always float32
    scan_layers: bool = True  # one compiled block, scanned over depth
    scan_unroll: int = 0  # blocks per scan iteration; 0: auto, every block on XLA:CPU without remat (XLA optimising), else 1 (lm.transformer.layers_per_iteration)
    remat: str = "none"  # what the backward pass recomputes, a policy in lm/remat.py (true: "full")
    loss_chunk: str = "auto"  # logits rows (tokens) per chunk of the fused LM head + loss; auto | none | N (lm/loss.py)
    track_attn_logits: bool = False  # report per-layer, per-head max pre-softmax logits
    attention: str = "auto"  # auto | xla | cudnn | pallas | tokamax (lm/attention.py)
    # Parallel modes (lm/parallel/): how the model runs over the `context` and `stage` mesh axes (sharding/axes.py).
    # None changes the parameters, so a resumed run may change any of them (experiments/run_spec.py).
    context_parallel: str = "all_gather"  # all_gather | ring | ulysses, over a `context` mesh axis (lm/parallel/context_attention.py)
    pipeline_schedule: str = "gpipe"  # gpipe | circular | 1f1b | zb_h1, over a `stage` mesh axis (lm/parallel/pipeline.py)
    pipeline_microbatches: int = 4  # M, microbatches per step (per gradient-accumulation micro-batch)
    pipeline_repeats: int = 1  # R, layer groups per stage; 1 except for circular
    pipeline_vocab_parallel: bool = False  # embedding and LM head + softmax split over `stage` (lm/parallel/vocab_parallel.py)
    pipeline_skip_rate: float = 0.0  # SkipPipe: share of stages each microbatch skips, gpipe only (lm/parallel/skip_pipe.py)
    document_separator: int | None = None  # token opening a document: attention stays inside documents
    # Mixture of experts (lm/moe.py); n_experts = 0: every block has a dense SwiGLU.
    n_experts: int = 0
    experts_per_token: int = 2
    n_shared_experts: int = 0  # always-on experts of expert_mlp_dim each
    moe_every: int = 1  # every moe_every-th block is MoE (the last of each group), the rest dense
    first_dense_layers: int = 0  # the first blocks stay dense whatever moe_every says (DeepSeek's first_k_dense_replace)
    expert_mlp_dim: int = 0  # 0: mlp_dim
    router_score: str = "softmax"  # softmax | sigmoid
    normalize_router_weights: bool = False  # divide the top-k gates by their sum (DeepSeek)
    router_scale: float = 1.0  # multiplies the routed experts' gates, after the normalisation (DeepSeek's routed_scaling_factor)
    router_groups: int = 1  # experts in this many contiguous groups; top-k only within the best groups (DeepSeek's n_group)
    router_topk_groups: int = 0  # groups kept per token, ranked by their best expert score; 0: every group (topk_group)
    capacity_factor: float = 0.0  # <= 0: dropless
    moe_matmul: str = "auto"  # auto | ragged_dot | gmm | tokamax: the dropless dispatch's grouped matmuls (lm/moe.py)
    # Multi-head latent attention (lm/mla.py); with it head_dim is the per-head query/key width without
    # RoPE, and n_kv_heads is unused (every head reads its keys and values from the shared latent).
    attention_type: str = "gqa"  # gqa | mla
    kv_lora_rank: int = 64  # width of the compressed key/value latent
    q_lora_rank: int = 0  # width of the compressed query latent; 0: full-rank query projection
    rope_head_dim: int = 16  # decoupled RoPE width of each query head and of the one shared RoPE key
    v_head_dim: int = 0  # value width per head; 0: head_dim
    # ParScale (lm/parscale.py): P parallel streams of the decoder, each with its own prefix keys and values in
    # every layer, mixed by learned dynamic weights; 1 is the plain model.
    parscale: int = 1  # P, streams
    parscale_prefix_tokens: int = 48  # T, prefix positions per stream and layer (the authors' parscale_n_tokens)
    parscale_smoothing: float = 0.01  # eps, label smoothing of the stream weights (the authors' parscale_attn_smooth)
    # modded-nanogpt speedrun options (lm/speedrun_config.py, lm/speedrun_blocks.py); the defaults change nothing.
    mlp_activation: str = "swiglu"  # swiglu | relu2: down(relu(up(x))^2) (So et al., arXiv:2109.08668)
    zero_init_head: bool = False  # the untied lm_head starts at zero
    logit_softcap: float = 0.0  # c > 0: logits c * tanh(z / c) (Gemma 2, arXiv:2408.00118); 0: off
    norm_scale: bool = True  # RMSNorms learn a scale; False: x / rms(x), no parameter
    attention_scale: float = 0.0  # attention logit scale; 0: head_dim ** -0.5
    embed_vocab_size: int = 0  # rows of the token and value embeddings under an untied head wider than them; 0: vocab_size
    value_embeddings: int = 0  # k: token tables mixed into the values of the first k and last k blocks
    unet_skips: bool = False  # decoder block i adds w_i times encoder block (n/2 - 1 - i)'s output, w learned
    # x0_mixing: with tied embeddings the unit-scale x0 is read out through its own table: `tiny` starts at loss 9.7, not 6.2;
    # untie the head and zero-initialise it, as the speedrun preset does.
    x0_mixing: bool = False  # x0 = RMSNorm(embedding); each block starts from a x + b x0, (a, b) learned
    skip_attention: str = ""  # comma-separated blocks without attention (the record's "7")
    attention_window: int = 0  # sliding window in tokens; 0: full causal attention
    window_block: int = 1  # window granularity: query block i sees key blocks i - window / window_block < j <= i
    window_pattern: str = ""  # one letter per layer: L (attention_window) or S (half of it); empty: all L
    window_warmup: int = 0  # K > 0: the windows grow from one block to full over training steps 0..K (the record: the run)
    # Lightning attention (lm/lightning.py): attention_type="lightning" makes layers MiniMax-01's linear attention.
    softmax_attention_every: int = 0  # k: every k-th layer (the last of each group) keeps softmax gqa; 0: lightning everywhere
    lightning_block: int = 64  # tokens per block of the blocked lightning attention
    # FP8 matrix products (lm/fp8.py) in the attention projections and dense MLPs: e4m3 inputs and weights,
    # gradients in e4m3 (e4m3) or e5m2 (hybrid); per-tensor scales from an amax history or the tensor itself.
    fp8: str = "none"  # none | e4m3 | hybrid
    fp8_scaling: str = "delayed"  # delayed (Transformer Engine, MaxText) | current (torchtitan)
    fp8_amax_history: int = 1024  # delayed scaling's window of past amaxes, in steps
    fp8_head: bool = False  # the untied LM head in FP8 too (needs tie_embeddings=False, loss_chunk=none)

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_lib.canonical(self.remat))
        problems = []
        chunk = str(self.loss_chunk).strip().lower()
        object.__setattr__(self, "loss_chunk", chunk)
        if chunk not in ("auto", "none") and not (chunk.isdigit() and int(chunk) > 0):
            problems.append(f"model.loss_chunk={self.loss_chunk!r} must be 'auto', 'none' or a positive number of tokens per chunk")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads:
            problems.append(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each kv head among n_heads / n_kv_heads query heads)"
            )
        if self.document_separator is not None and not 0 <= self.document_separator < self.vocab_size:
            problems.append(f"the document separator id {self.document_separator} lies outside model.vocab_size={self.vocab_size}")
        if not self.rope_theta > 0:  # the rotary frequencies are theta ** (-2i / d)
            problems.append(f"model.rope_theta={self.rope_theta} must be > 0")
        if not self.norm_eps >= 0:
            problems.append(f"model.norm_eps={self.norm_eps} must be >= 0")
        if self.scan_unroll < 0:
            problems.append(f"model.scan_unroll={self.scan_unroll} must be >= 1, or 0 for auto")
        if self.head_dim % 2:
            problems.append(f"model.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.dtype not in ("float32", "bfloat16"):
            problems.append(f"model.dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            problems.append(f"model.attention={self.attention!r} must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if self.context_parallel not in CONTEXT_PARALLEL:
            problems.append(f"model.context_parallel={self.context_parallel!r} must be one of {', '.join(CONTEXT_PARALLEL)}")
        if self.rope_scaling != "none":
            problems += self._rope_problems()
        if self.n_experts:
            problems += self._moe_problems()
        if self.attention_type not in ATTENTION_TYPES:
            problems.append(f"model.attention_type={self.attention_type!r} must be one of {', '.join(ATTENTION_TYPES)}")
        if self.attention_type == "mla":
            if self.kv_lora_rank < 1 or self.q_lora_rank < 0 or self.v_head_dim < 0:
                problems.append("model.kv_lora_rank must be >= 1 and model.q_lora_rank, model.v_head_dim >= 0 for mla")
            if self.rope_head_dim < 2 or self.rope_head_dim % 2:
                problems.append(f"model.rope_head_dim={self.rope_head_dim} must be even and >= 2 for mla")
            if self.qk_norm:
                problems.append("model.qk_norm applies to gqa only (mla normalises its latents); set it to False")
        if self.parscale != 1:
            problems += self._parscale_problems()
        problems += speedrun_config.problems(self)
        if self.attention_type == "lightning" or self.softmax_attention_every:
            problems += self._lightning_problems()
        problems += fp8_lib.problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def _parscale_problems(self) -> list[str]:
        problems = []
        if self.parscale < 1 or self.parscale_prefix_tokens < 1 or not 0 <= self.parscale_smoothing <= 1:
            problems.append("model.parscale and model.parscale_prefix_tokens must be >= 1 and model.parscale_smoothing in [0, 1]")
        if self.attention_type != "gqa":
            problems.append("model.parscale > 1 prefixes grouped-query attention's keys and values; set model.attention_type=gqa")
        if self.document_separator is not None:
            problems.append("model.parscale > 1 shows every stream prefix to all positions, across document masks; unset model.document_separator")
        if self.value_embeddings or self.unet_skips or self.x0_mixing or self.attention_window:
            problems.append(
                "model.parscale > 1 is not built with the speedrun's block options (value_embeddings, unet_skips, "
                "x0_mixing, attention_window); set model.parscale=1 or turn them off"
            )
        return problems

    def _lightning_problems(self) -> list[str]:
        if self.attention_type != "lightning":
            return [f"model.softmax_attention_every={self.softmax_attention_every} needs model.attention_type=lightning"]
        problems = []
        if self.softmax_attention_every < 0 or self.lightning_block < 1:
            problems.append("model.softmax_attention_every must be >= 0 (0: lightning everywhere) and model.lightning_block >= 1")
        if self.scan_layers:
            problems.append("model.attention_type=lightning gives each layer its own decay rates, which a scan cannot; set model.scan_layers=False")
        if self.track_attn_logits:
            problems.append("model.track_attn_logits needs softmax logits, which lightning layers have none of; set it to False")
        if self.value_embeddings or self.attention_window:
            problems.append("lightning layers take no value embeddings or attention window; set model.value_embeddings=0 and model.attention_window=0")
        return problems

    def _rope_problems(self) -> list[str]:
        if self.rope_scaling not in ROPE_SCALINGS:
            return [f"model.rope_scaling={self.rope_scaling!r} must be one of {', '.join(ROPE_SCALINGS)}"]
        problems = []
        if self.rope_factor <= 0:
            problems.append(f"model.rope_factor={self.rope_factor} must be > 0")
        if self.rope_original_max_len < 0:
            problems.append(f"model.rope_original_max_len={self.rope_original_max_len} must be >= 0 (0: model.max_seq_len)")
        if self.rope_scaling == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            problems.append("llama3 RoPE needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor")
        if self.rope_scaling == "dynamic" and self.head_dim <= 2:
            problems.append("dynamic RoPE needs model.head_dim > 2")
        if self.rope_scaling == "yarn" and (self.rope_beta_fast <= 0 or self.rope_beta_slow <= 0):
            problems.append("yarn RoPE needs model.rope_beta_fast and model.rope_beta_slow > 0")
        return problems

    def _moe_problems(self) -> list[str]:
        problems = []
        if not 1 <= self.experts_per_token <= self.n_experts:
            problems.append(f"model.experts_per_token={self.experts_per_token} must be in [1, model.n_experts={self.n_experts}]")
        if self.moe_matmul not in MOE_MATMULS:
            problems.append(f"model.moe_matmul={self.moe_matmul!r} must be one of {', '.join(MOE_MATMULS)}")
        if self.router_score not in ("softmax", "sigmoid"):
            problems.append(f"model.router_score={self.router_score!r} must be 'softmax' or 'sigmoid'")
        if self.moe_every < 1 or self.n_layers % self.moe_every:
            problems.append(f"model.moe_every={self.moe_every} must be >= 1 and divide model.n_layers={self.n_layers}")
        if not 0 <= self.first_dense_layers < self.n_layers:
            problems.append(f"model.first_dense_layers={self.first_dense_layers} must be in [0, model.n_layers={self.n_layers})")
        if (self.moe_every > 1 or self.first_dense_layers) and self.scan_layers:
            problems.append(
                "model.moe_every > 1 or model.first_dense_layers > 0 mixes dense and MoE blocks, which cannot be scanned; "
                "set model.scan_layers=False"
            )
        if self.n_shared_experts < 0 or self.expert_mlp_dim < 0:
            problems.append("model.n_shared_experts and model.expert_mlp_dim must be >= 0")
        if not self.router_scale > 0:
            problems.append(f"model.router_scale={self.router_scale} must be > 0")
        if self.router_groups < 1 or self.n_experts % self.router_groups:
            problems.append(f"model.router_groups={self.router_groups} must be >= 1 and divide model.n_experts={self.n_experts}")
        elif not 0 <= self.router_topk_groups <= self.router_groups:
            problems.append(f"model.router_topk_groups={self.router_topk_groups} must be in [0, model.router_groups={self.router_groups}] (0: every group)")
        elif 0 < self.router_topk_groups < self.router_groups and self.experts_per_token > self.routable_experts:
            problems.append(
                f"model.experts_per_token={self.experts_per_token} exceeds the {self.routable_experts} experts of "
                f"model.router_topk_groups={self.router_topk_groups} groups of {self.n_experts // self.router_groups}"
            )
        return problems

    @property
    def routable_experts(self) -> int:
        """Experts a token may choose from: those of its ``router_topk_groups`` best groups (all without groups)."""
        return (self.router_topk_groups or self.router_groups) * (self.n_experts // self.router_groups)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.first_dense_layers and (layer + 1) % self.moe_every == 0

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def value_head_dim(self) -> int:
        """Width of one head's values (and of the attention output per head)."""
        return self.v_head_dim if self.attention_type == "mla" and self.v_head_dim else self.head_dim

    def attention_matmul_params(self) -> int:
        """Parameters of one block's attention projections (matrices only)."""
        d, hd, h = self.d_model, self.head_dim, self.n_heads
        if self.attention_type == "gqa":
            return d * hd * (2 * h + 2 * self.n_kv_heads)
        r, rope, vd = self.kv_lora_rank, self.rope_head_dim, self.value_head_dim
        q_out = h * (hd + rope)
        query = d * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else d * q_out
        return query + d * (r + rope) + r * h * (hd + vd) + h * vd * d


# The options every speedrun preset shares (lm/speedrun_blocks.py): the record's logit soft-cap 15 and attention scale 0.12.
SPEEDRUN_OPTIONS = dict(
    mlp_activation="relu2", zero_init_head=True, logit_softcap=15.0, norm_scale=False, attention_scale=0.12, unet_skips=True, x0_mixing=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.8M parameters: learns Python bytes in a minute on 2 CPU cores.
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=1024),
    # ~20M parameters.
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=1152, max_seq_len=1024),
    # GPT-2 small's shape (124M with a 50k vocabulary), SwiGLU sized to GPT-2's MLP parameter count.
    "gpt2-124m": dict(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, mlp_dim=2048, max_seq_len=1024
    ),
    # modded-nanogpt's GPT-2 speedrun record 21 (track 1, 2025-01-26, 2.933 minutes on 8 H100s; README
    # "GPT-2 speedrun"): 275,598,388 parameters, 38.6M of them the untied head padded to 50304 rows.
    "speedrun-124m": dict(
        vocab_size=50304, embed_vocab_size=50257, d_model=768, n_layers=12, n_heads=6, n_kv_heads=6, head_dim=128,
        mlp_dim=3072, max_seq_len=262144, tie_embeddings=False, qk_norm=True, dtype="bfloat16", scan_layers=False,
        **SPEEDRUN_OPTIONS, value_embeddings=3, skip_attention="7", attention_window=1792, window_block=128,
        window_pattern="LSSSLSSLSSSL",
    ),
    # The same options at `tiny`'s width on the byte-level stdlib corpus: the harness end to end on a CPU.
    "speedrun-tiny": dict(
        d_model=128, n_layers=4, n_heads=2, n_kv_heads=2, head_dim=64, mlp_dim=512, max_seq_len=1024, tie_embeddings=False,
        qk_norm=True, scan_layers=False, **SPEEDRUN_OPTIONS, value_embeddings=1, attention_window=128, window_block=32,
        window_pattern="LSSL",
    ),
    # Llama 3.2 1B's shape.
    "llama-1b": dict(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        max_seq_len=8192,
        rope_theta=500_000.0,
        norm_eps=1e-5,
    ),
    # Mixture-of-experts presets (lm/moe.py). Each routed expert is mlp_dim / experts_per_token wide,
    # so the active parameters match the dense preset of the same shape (tiny, small).
    "moe-tiny": dict(
        d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384, max_seq_len=1024,
        n_experts=8, experts_per_token=2, expert_mlp_dim=192,
    ),
    "moe-small": dict(
        d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=1152, max_seq_len=1024,
        n_experts=16, experts_per_token=2, n_shared_experts=1, expert_mlp_dim=384,
    ),
    # Mixtral 8x7B's shape (46.7B parameters, 12.9B active): for the memory planner on expert + fsdp meshes.
    "mixtral-8x7b": dict(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, mlp_dim=14336,
        max_seq_len=32768, rope_theta=1_000_000.0, norm_eps=1e-5, tie_embeddings=False, n_experts=8, experts_per_token=2,
    ),
    # DeepSeek-V2-Lite's shape (arXiv:2405.04434, appendix B; 15.7B parameters, 2.4B active without the
    # embedding lookup): MLA without query compression, 64 routed experts top-6 plus 2 shared, the first
    # block dense. For the memory planner on expert + fsdp meshes.
    "deepseek-v2-lite": dict(
        vocab_size=102400, d_model=2048, n_layers=27, n_heads=16, head_dim=128, mlp_dim=10944, max_seq_len=4096,
        tie_embeddings=False, attention_type="mla", kv_lora_rank=512, q_lora_rank=0, rope_head_dim=64, v_head_dim=128,
        n_experts=64, experts_per_token=6, n_shared_experts=2, expert_mlp_dim=1408, first_dense_layers=1, scan_layers=False,
    ),
}  # fmt: skip


DEFAULT_PRESET = "tiny"  # the README main job's model: --config.model.preset when unset


def preset_fields(name: str) -> dict[str, Any]:
    """The fields preset ``name`` sets (an unknown name is an error naming the presets)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; set --config.model.preset to one of {', '.join(PRESETS)}")
    return PRESETS[name]


def from_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (unknown fields are an error)."""
    preset = preset_fields(name)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model fields {unknown}; known: {sorted(fields)}")
    return ModelConfig(**{**preset, **overrides})
