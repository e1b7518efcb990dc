"""Float64 NumPy references for the Muon family tests, written from the papers' update rules, and
the JAX harness the four test files share (test_muon.py, test_normuon.py, test_mars_muon.py,
test_muon_clip.py). The coefficient tables are copied here from the papers / reference code,
independently of optim/newton_schulz.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import labels
from sharding import partition

JORDAN = [(3.4445, -4.7750, 2.0315)]
_PE_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
POLAR_EXPRESS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_RAW[:-1]] + [_PE_RAW[-1]]
DION = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
# name: (table, default steps, preconditioning, safety factor on the Frobenius norm)
PRESETS = {
    "jordan": (JORDAN, 5, "frobenius", 1.0),
    "polar_express": (POLAR_EXPRESS, 5, "frobenius", 1.01),
    "turbo": (DION[1:], 4, "aol", 1.0),
}


def preset_spec(coeffs):
    if isinstance(coeffs, str):
        return PRESETS[coeffs]
    return list(coeffs), len(coeffs), "frobenius", 1.0


def normalize(x, coeffs="jordan", eps=1e-7):
    """The iteration's starting point: wide orientation, Frobenius (and AOL) scaling."""
    _, _, precondition, safety = preset_spec(coeffs)
    x = x / (safety * np.linalg.norm(x) + eps)
    if precondition == "aol":
        row_sums = np.abs(x @ x.T).sum(axis=1)
        x = x / np.sqrt(np.maximum(row_sums, eps))[:, None]
    return x


def newton_schulz(x, coeffs="jordan", steps=0, eps=1e-7):
    """Polar factor approximation of one matrix: X <- a X + b (X X^T) X + c (X X^T)^2 X."""
    table, default_steps, _, _ = preset_spec(coeffs)
    tall = x.shape[0] > x.shape[1]
    x = normalize(x.T if tall else x, coeffs, eps)
    for i in range(steps or default_steps):
        a, b, c = table[min(i, len(table) - 1)]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def orthogonalize(x, coeffs="jordan", steps=0, eps=1e-7):
    """`newton_schulz` on every matrix of a ``(*batch, fan_in, fan_out)`` array."""
    flat = x.reshape(-1, *x.shape[-2:])
    return np.stack([newton_schulz(m, coeffs, steps, eps) for m in flat]).reshape(x.shape)


def shape_scale(shape, kind):
    fan_in, fan_out = shape[-2:]
    if kind == "jordan":
        return np.sqrt(max(1.0, fan_out / fan_in))
    return 0.2 * np.sqrt(max(fan_in, fan_out))


def momentum(g, mu, beta, form, nesterov):
    """(direction, new momentum): Jordan's EMA or the torch-SGD sum form, with optional Nesterov."""
    if form == "ema":
        mu = beta * mu + (1 - beta) * g
        return (beta * mu + (1 - beta) * g if nesterov else mu), mu
    mu = beta * mu + g
    return (g + beta * mu if nesterov else mu), mu


def muon_direction(*, beta, form, nesterov, coeffs, steps, scale, eps=1e-7):
    """Muon's direction ``s(W) NewtonSchulz(D_t)`` with its momentum kept per leaf."""
    mus = {}

    def direction(key, g, p):
        d, mus[key] = momentum(g, mus.get(key, 0.0), beta, form, nesterov)
        return shape_scale(p.shape, scale) * orthogonalize(d, coeffs, steps, eps)

    return direction


def is_matrix(path, leaf):
    """Hidden matrices: two or more axes, not a (stacked) norm scale or bias, not a vocabulary table."""
    names = [str(getattr(k, "key", k)) for k in path]
    return leaf.ndim >= 2 and names[-1] not in ("scale", "bias") and not set(names) & {"embed", "embedding", "lm_head"}


def is_decayed(path, leaf):
    """Weight decay by role: leaves of two or more axes that are not (stacked) norm scales or biases."""
    return leaf.ndim >= 2 and str(getattr(path[-1], "key", path[-1])) not in ("scale", "bias")


class AdamW:
    """Loshchilov & Hutter's AdamW with bias correction; ``update(..., wd)`` decays by ``wd``."""

    def __init__(self, b1=0.9, b2=0.95, eps=1e-8):
        self.b1, self.b2, self.eps = b1, b2, eps
        self.m, self.v, self.t = {}, {}, {}

    def update(self, key, g, p, lr, wd):
        m = self.b1 * self.m.get(key, 0.0) + (1 - self.b1) * g
        v = self.b2 * self.v.get(key, 0.0) + (1 - self.b2) * g * g
        t = self.t.get(key, 0) + 1
        self.m[key], self.v[key], self.t[key] = m, v, t
        step = (m / (1 - self.b1**t)) / (np.sqrt(v / (1 - self.b2**t)) + self.eps)
        return -lr * (step + wd * p)


def model_tree(seed, *, layers=2, d=8, heads=2, kv_heads=1, head_dim=4, mlp=12, vocab=11, untied=False, scale=1.0):
    """A miniature of the LM's parameter tree (float64), scan-stacked layers."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return scale * rng.standard_normal(shape)

    tree = {
        "embed": {"embedding": r(vocab, d)},
        "blocks": {
            "attn_norm": {"scale": r(layers, d)},
            "attn": {
                "q_proj": {"kernel": r(layers, d, heads * head_dim)},
                "k_proj": {"kernel": r(layers, d, kv_heads * head_dim)},
                "v_proj": {"kernel": r(layers, d, kv_heads * head_dim)},
                "o_proj": {"kernel": r(layers, heads * head_dim, d)},
            },
            "mlp": {
                "gate_proj": {"kernel": r(layers, d, mlp)},
                "down_proj": {"kernel": r(layers, mlp, d)},
            },
        },
        "final_norm": {"scale": r(d)},
    }
    if untied:
        tree["lm_head"] = {"kernel": r(d, vocab)}
    return tree


def f32(tree):
    """The float32-rounded tree, as float64 (what the JAX run sees, exactly)."""
    return jax.tree.map(lambda x: np.asarray(x, np.float32).astype(np.float64), tree)


def run_matrix_family(params, grads_seq, direction_fn, *, lr, adam_lr, wd, adam=None, post_step=None):
    """Runs a matrix optimizer: ``direction_fn(key, g, p)`` on matrices, AdamW elsewhere.

    The full update is ``-lr (direction + wd W)`` on matrices; ``post_step(t, params)``, if given,
    then maps the new parameters (QK-clip). Returns the parameters after each step.
    """
    adam = adam or AdamW()
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    values = [leaf for _, leaf in flat]
    history = []
    for grads in grads_seq:
        g_leaves = jax.tree.leaves(grads)
        new = []
        for i, ((path, _), p, g) in enumerate(zip(flat, values, g_leaves, strict=True)):
            if is_matrix(path, p):
                new.append(p - lr * (direction_fn(i, g, p) + wd * p))
            else:
                new.append(p + adam.update(i, g, p, adam_lr, wd if is_decayed(path, p) else 0.0))
        tree = treedef.unflatten(new)
        if post_step is not None:
            tree = post_step(len(history), tree)
        values = jax.tree.leaves(tree)
        history.append(tree)
    return history


def grads_sequence(params, n=6, seed=100, scale=1.0):
    """``n`` float32-representable random gradient trees."""
    return [
        f32(jax.tree.map(lambda p, s=seed + t: scale * np.random.default_rng(s).standard_normal(p.shape), params))
        for t in range(n)
    ]


def run_jax(tx, params, grads_seq, extra_seq=None):
    """Parameters after each step of ``tx`` under `jax.jit`, as float64 NumPy."""
    params = jax.tree.map(jnp.float32, params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    out = []
    for t, grads in enumerate(grads_seq):
        extra = extra_seq[t] if extra_seq else {}
        params, state = step(params, state, jax.tree.map(jnp.float32, grads), extra)
        out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), params))
    return out


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    """rtol 1e-5; the atol (1e-5 of the parameters' ~0.1 scale) only matters for entries near 0."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def fsdp_shardings(params, mesh):
    """FSDP-like layout: stacked kernels sharded on their d_model side, everything else replicated."""

    def spec(path, p):
        names = labels.path_names(path)
        if p.ndim == 3:
            return jax.P(None, None, "fsdp") if names[-2] in ("o_proj", "down_proj") else jax.P(None, "fsdp", None)
        return jax.P()

    return jax.tree_util.tree_map_with_path(lambda path, p: jax.NamedSharding(mesh, spec(path, p)), params)


def step_fn(tx, extra=None):
    """``(params, state, grads) -> (params, state)``: one update of ``tx`` applied."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, **(extra or {}))
        return optax.apply_updates(params, updates), state

    return step


def check_sharded_matches_single_device(tx, params, grads, extra=None, state_fields=("mu",)):
    """One step on 8 devices (state placed by `sharding.partition.state_shardings`) equals the
    single-device step, and the named state fields come out sharded like their parameters."""
    expected, _ = jax.jit(step_fn(tx, extra))(params, tx.init(params), grads)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        p_shard = fsdp_shardings(params, mesh)
        s_shard = partition.state_shardings(jax.eval_shape(tx.init, params), params, p_shard, mesh)
        state = jax.jit(tx.init, out_shardings=s_shard)(jax.device_put(params, p_shard))
        step = jax.jit(step_fn(tx, extra), in_shardings=(p_shard, s_shard, p_shard), out_shardings=(p_shard, s_shard))
        new_params, new_state = step(jax.device_put(params, p_shard), state, jax.device_put(grads, p_shard))
    assert_trees_close(new_params, expected)
    paths = [str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    by_path = dict(zip(paths, jax.tree.leaves(p_shard), strict=True))
    partitioned = new_state if hasattr(new_state, "inner_states") else new_state[0]  # muon_clip: a chain
    inner = partitioned.inner_states["matrix"].inner_state[0]
    for field in state_fields:
        leaves = jax.tree_util.tree_leaves_with_path(getattr(inner, field))
        assert leaves
        for path, leaf in leaves:
            assert leaf.sharding == by_path[str(path)], (field, path, leaf.sharding)


def regression_loss_ratio(tx, steps=60, seed=0):
    """Final / initial loss of ``tx`` on a matrix regression ``min_W ||X W - Y||^2`` with a bias."""
    rng = np.random.default_rng(seed)
    x = jnp.float32(rng.standard_normal((64, 16)))
    w_true = jnp.float32(rng.standard_normal((16, 24)) / 4)
    y = x @ w_true + 0.5
    params = {"w": jnp.zeros((16, 24)), "bias": jnp.zeros(24)}

    def loss(p):
        return jnp.mean(jnp.square(x @ p["w"] + p["bias"] - y))

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state = tx.init(params)
    first = None
    for _ in range(steps):
        params, state, value = step(params, state)
        first = value if first is None else first
    return float(loss(params) / first)
