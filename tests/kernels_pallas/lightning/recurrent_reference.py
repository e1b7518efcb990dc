"""Lightning attention's recurrent definition in NumPy, token by token (written from the papers' equations).

    S_t = lambda_h [same document as t-1] S_{t-1} + k_t^T v_t,    o_t = q_t S_t,    lambda_h = exp(-s_h)

MiniMax-01 (arXiv:2501.08313) eq. for lightning attention's decode; Lightning Attention-2
(arXiv:2401.04658) eq. (4): ``kv_t = lambda kv_{t-1} + k_t^T v_t``, ``o_t = q_t kv_t``.
"""

import numpy as np


def recurrent(q, k, v, slopes, segment_ids=None, state=None):
    """``(out (batch, seq, heads, d_v), final state (batch, heads, d, d_v))`` in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq, heads, d = q.shape
    s = np.zeros((batch, heads, d, v.shape[3])) if state is None else np.array(state, np.float64)
    lam = np.exp(-np.asarray(slopes, np.float64))
    out = np.zeros((batch, seq, heads, v.shape[3]))
    for t in range(seq):
        for b in range(batch):
            reset = t > 0 and segment_ids is not None and segment_ids[b, t] != segment_ids[b, t - 1]
            for h in range(heads):
                s[b, h] = (0.0 if reset else lam[h]) * s[b, h] + np.outer(k[b, t, h], v[b, t, h])
                out[b, t, h] = q[b, t, h] @ s[b, h]
    return out, s
