"""Temperature, top-k and top-p filtering against a NumPy rendering of their definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import sampling


def reference_probs(logits, temperature, top_k, top_p):
    """The sampled distribution, from the definitions: top-k, then the nucleus of what is left."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    kept, mass = [], 0.0
    for i in order:  # most probable first, until the kept mass reaches top_p
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i]
    q = np.zeros_like(p)
    q[kept] = p[kept]
    return q / q.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.6), (1.0, 0, 1e-3)])
def test_filtered_distribution_matches_the_definition(temperature, top_k, top_p):
    logits = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32) * 2
    got = jax.nn.softmax(sampling.filter_logits(jnp.asarray(logits), temperature=temperature, top_k=top_k, top_p=top_p))
    for row, probs in zip(logits, np.asarray(got)):
        np.testing.assert_allclose(probs, reference_probs(row, temperature, top_k, top_p), atol=1e-6)


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = np.random.default_rng(1).standard_normal(8).astype(np.float32)
    n = 5_000
    tokens = sampling.next_token(
        jax.random.key(0), jnp.broadcast_to(jnp.asarray(logits), (n, 8)), temperature=0.8, top_k=4, top_p=0.9
    )
    freq = np.bincount(np.asarray(tokens), minlength=8) / n
    expected = reference_probs(logits, 0.8, 4, 0.9)
    np.testing.assert_allclose(freq, expected, atol=4 * np.sqrt(0.25 / n))  # 4 sigma of a binomial
    assert np.all(freq[expected == 0] == 0)


def test_greedy_is_argmax_and_bad_settings_name_the_fix():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((3, 10)), jnp.float32)
    np.testing.assert_array_equal(sampling.next_token(jax.random.key(0), logits, temperature=0.0), jnp.argmax(logits, -1))
    with pytest.raises(ValueError, match="top_p=0.0 in"):
        sampling.filter_logits(logits, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature=-1 must be >= 0"):
        sampling.filter_logits(logits, temperature=-1)
    with pytest.raises(ValueError, match="top_k=-2 must be >= 0"):
        sampling.make_generate(None, max_new_tokens=1, temperature=0.0, top_k=-2)
