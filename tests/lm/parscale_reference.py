"""The authors' ParScale forward pass transcribed to NumPy (float64), on our parameter names.

From QwenLM/ParScale ``modeling_qwen2_parscale.py`` (``Qwen2Model.forward`` and ``Qwen2Attention``
with ``parscale_n > 1``), on our architecture (no q/k/v biases, optional tied head): the embedded
input copied to ``(n_parscale b)`` rows, stream-major as the authors lay them out; in every layer the
stream's prefix keys and values (no RoPE) before the sequence's, visible to every query, the sequence
itself causal; the final RMSNorm's states rearranged ``(n b) s h -> b s (h n)`` into the aggregation
MLP (Linear, SiLU, Linear), softmax, ``w (1 - eps) + eps / n``, the weighted sum of the states, the
head. The mask is written out here, not the authors' zero-query device, so the test checks that too.
"""

import numpy as np

from tests.lm import rope_reference


def _rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, theta):
    """Rotate-half RoPE of ``x`` ``(rows, seq, heads, head_dim)`` at positions ``0 .. seq - 1``."""
    inv_freq, _ = rope_reference.default({"rope_theta": theta}, x.shape[-1], 0)
    angles = np.arange(x.shape[1])[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax(z, axis=-1):
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def _silu(x):
    return x / (1 + np.exp(-x))


def forward(params, tokens, cfg):
    """Logits ``(batch, seq, vocab)`` of a scan-stacked parameter dict (float64 NumPy leaves)."""
    n, b, s = cfg.parscale, *tokens.shape
    hd, kv, h = cfg.head_dim, cfg.n_kv_heads, cfg.n_heads
    x = np.tile(params["embed"]["embedding"][tokens], (n, 1, 1))  # "b s h -> (n_parscale b) s h"
    for layer in range(cfg.n_layers):
        blk = {name: {k: w[layer] for k, w in leaves.items()} for name, leaves in params["blocks"]["attn"].items()}
        y = _rms_norm(x, params["blocks"]["attn_norm"]["scale"][layer], cfg.norm_eps)
        q = _rope((y @ blk["q_proj"]["kernel"]).reshape(n * b, s, h, hd), cfg.rope_theta)
        k = _rope((y @ blk["k_proj"]["kernel"]).reshape(n * b, s, kv, hd), cfg.rope_theta)
        v = (y @ blk["v_proj"]["kernel"]).reshape(n * b, s, kv, hd)
        if n > 1:  # ParscaleCache: prefix (n, ...) repeated to "(n_parscale b) ..."
            k = np.concatenate([np.repeat(blk["prefix"]["k"], b, axis=0), k], axis=1)
            v = np.concatenate([np.repeat(blk["prefix"]["v"], b, axis=0), v], axis=1)
        t = k.shape[1] - s
        visible = np.arange(t + s)[None, :] <= t + np.arange(s)[:, None]  # prefix always, then causal
        k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)  # repeat_kv
        scores = np.einsum("rqhd,rkhd->rhqk", q, k) * hd**-0.5
        probs = _softmax(np.where(visible, scores, -np.inf))
        out = np.einsum("rhqk,rkhd->rqhd", probs, v).reshape(n * b, s, h * hd)
        x = x + out @ blk["o_proj"]["kernel"]
        mlp = {name: w["kernel"][layer] for name, w in params["blocks"]["mlp"].items()}
        y = _rms_norm(x, params["blocks"]["mlp_norm"]["scale"][layer], cfg.norm_eps)
        x = x + (_silu(y @ mlp["gate_proj"]) * (y @ mlp["up_proj"])) @ mlp["down_proj"]
    hidden = _rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps).reshape(n, b, s, -1)
    if n > 1:
        agg = params["aggregate"]
        features = hidden.transpose(1, 2, 3, 0).reshape(b, s, -1)  # "(n b) s h -> b s (h n)"
        z = _silu(features @ agg["hidden"]["kernel"] + agg["hidden"]["bias"])
        w = _softmax(z @ agg["weights"]["kernel"] + agg["weights"]["bias"])
        w = w * (1 - cfg.parscale_smoothing) + cfg.parscale_smoothing / n
        merged = np.einsum("nbsd,bsn->bsd", hidden, w)
    else:
        merged = hidden[0]
    head = params["embed"]["embedding"].T if cfg.tie_embeddings else params["lm_head"]["kernel"]
    return merged @ head
