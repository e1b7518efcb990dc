"""Packed-sequence batches: deterministic, seedable, resumable, and sliced per process.

The token stream is cut into ``n = (len - 1) // seq_len`` windows of ``seq_len + 1`` tokens (window
``w`` starts at ``w * seq_len``; inputs are its first ``seq_len`` tokens, targets its last). Global
sample ``i`` is window ``perm_e[i mod n]`` of epoch ``e = i // n``, where ``perm_e`` is a permutation
seeded by ``(seed, e)``. Batch ``t`` holds samples ``t * B ... (t + 1) * B - 1``, so the whole
iterator state is the step ``t``: restoring it resumes exactly, on any number of processes.
"""

from __future__ import annotations

import numpy as np


class PackedBatches:
    """Iterator over ``(local_batch, seq_len + 1)`` int32 batches of a token stream.

    Args:
      tokens: 1-D token stream (may be memory-mapped).
      seq_len: tokens per training sequence.
      global_batch: sequences per step across all processes.
      seed: permutation seed.
      process_index, process_count: this process's share is rows
        ``[process_index * local_batch, (process_index + 1) * local_batch)`` of each global batch.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if global_batch % process_count:
            raise ValueError(f"batch_size={global_batch} must be divisible by the number of processes ({process_count})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.seed = seed
        self.process_index = process_index
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the training split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; use a larger corpus or a smaller data.seq_len")
        self.step = 0
        self._perm_epoch = -1
        self._perm = np.zeros((0,), np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def _window(self, w: int) -> np.ndarray:
        start = w * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)

    def batch_at(self, step: int) -> np.ndarray:
        """This process's rows of global batch ``step``."""
        first = step * self.global_batch + self.process_index * self.local_batch
        rows = []
        for i in range(first, first + self.local_batch):
            epoch, offset = divmod(i, self.num_windows)
            rows.append(self._window(int(self._permutation(epoch)[offset])))
        return np.stack(rows)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def set_state(self, state: dict) -> None:
        for key in ("seed", "seq_len", "global_batch"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpointed data state has {key}={state[key]} but this run has {getattr(self, key)}; "
                    "resume with the original data settings or use a fresh workdir"
                )
        self.step = int(state["step"])


def validation_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, num_batches: int, *, process_index: int = 0, process_count: int = 1
) -> list[np.ndarray]:
    """A fixed held-out set: ``num_batches`` batches of windows spread evenly over the validation split.

    When the split holds fewer windows than requested, the number of batches shrinks to fit.

    Raises:
      ValueError: the split is shorter than one window per row of a batch.
    """
    num_windows = (len(tokens) - 1) // seq_len
    num_batches = min(num_batches, num_windows // batch_size)
    if num_batches < 1:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens, too few for one batch of {batch_size} x {seq_len + 1}; "
            "raise data.val_fraction or lower batch_size / data.seq_len"
        )
    picks = np.linspace(0, num_windows - 1, num_batches * batch_size).astype(np.int64).reshape(num_batches, batch_size)
    local = batch_size // process_count
    out = []
    for row in picks:
        mine = row[process_index * local : (process_index + 1) * local]
        out.append(np.stack([np.asarray(tokens[w * seq_len : w * seq_len + seq_len + 1], dtype=np.int32) for w in mine]))
    return out
