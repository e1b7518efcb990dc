"""Packed-sequence batches through Grain: deterministic, seedable, resumable, and sliced per process.

A `Windows` source holds ``n`` windows of ``seq_len + 1`` tokens over one or more token arrays
(inputs are a window's first ``seq_len`` tokens, targets its last): by default window ``w`` of an array
starts at ``w * seq_len``; `document_starts` gives windows that start at documents instead. Global
sample ``i`` is window ``pi_e(i mod n)`` of epoch ``e = i // n``, where ``pi_e`` is Grain's index
shuffle seeded by ``seed + e`` (a bijection computed per index, so no permutation is stored and the
source may be billions of windows). Batch ``t`` holds samples ``t * B ... (t + 1) * B - 1``; a process
builds only its rows, in Grain worker threads ahead of the step. The whole iterator state is the step
``t``: restoring it resumes exactly, on any number of processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

READ_AHEAD_BATCHES = 4


def document_starts(tokens: np.ndarray, seq_len: int, separator_id: int) -> np.ndarray:
    """Window starts aligned to documents: every ``separator_id`` position (a document's first token),
    then every ``seq_len`` tokens further while the same document lasts, so long documents are read whole.

    A stream that does not begin with a separator starts a document at position 0 too.
    """
    separators = np.flatnonzero(np.asarray(tokens) == separator_id)
    if separators.size == 0 or separators[0] != 0:
        separators = np.concatenate([[0], separators])
    ends = np.append(separators[1:], len(tokens))
    chunks = -(-(ends - separators) // seq_len)
    starts = np.repeat(separators, chunks) + seq_len * (np.arange(chunks.sum()) - np.repeat(np.cumsum(chunks) - chunks, chunks))
    return starts[starts + seq_len + 1 <= len(tokens)]


class Windows:
    """Random-access windows of ``seq_len + 1`` int32 tokens over one or more token arrays (a Grain data source).

    Args:
      streams: 1-D token arrays (may be memory-mapped); windows never cross from one to the next.
      seq_len: tokens per training sequence.
      starts: per stream, the window start offsets (default: ``0, seq_len, 2 * seq_len, ...``).
      name: what the streams are, for the error (e.g. ``data.val_files=data/x/val_*.bin``).

    Raises:
      ValueError: no stream holds a single window.
    """

    def __init__(
        self, streams: Sequence[np.ndarray], seq_len: int, starts: Sequence[np.ndarray] | None = None, *, name: str = "the token streams"
    ):
        self.streams = list(streams)
        self.seq_len = seq_len
        if starts is None:
            starts = [np.arange(max(len(s) - 1, 0) // seq_len, dtype=np.int64) * seq_len for s in self.streams]
        self.starts = [np.asarray(s, np.int64) for s in starts]
        self._first = np.cumsum([0] + [len(s) for s in self.starts])
        if self._first[-1] < 1:
            raise ValueError(
                f"{name}: {sum(len(s) for s in self.streams)} tokens, not one window of seq_len + 1 = "
                f"{seq_len + 1}; use more data or a smaller data.seq_len"
            )

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        k = int(np.searchsorted(self._first, index, side="right")) - 1
        start = int(self.starts[k][index - self._first[k]])
        return np.asarray(self.streams[k][start : start + self.seq_len + 1], dtype=np.int32)


class PackedBatches:
    """Iterator over ``(local_batch, seq_len + 1)`` int32 batches of shuffled windows.

    Args:
      source: a `Windows` source or a Grain ``MapDataset`` of windows (e.g. a mixture), or one 1-D
        token stream (then ``Windows([tokens], seq_len)``).
      seq_len: tokens per training sequence.
      global_batch: sequences per step across all processes.
      seed: shuffle seed.
      process_index, process_count: this process's share is rows
        ``[process_index * local_batch, (process_index + 1) * local_batch)`` of each global batch.
      read_ahead: batches prepared ahead of the step in Grain worker threads (0: built on demand).
      shuffle: False reads ``source`` in order (a mixture of already shuffled sources).
      name: what the source is (files, windowing), saved with the state so a resume on other data is refused.
    """

    def __init__(
        self,
        source: Windows | grain.MapDataset | np.ndarray,
        seq_len: int,
        global_batch: int,
        *,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        read_ahead: int = READ_AHEAD_BATCHES,
        shuffle: bool = True,
        name: str = "",
    ):
        if global_batch % process_count:
            raise ValueError(f"batch_size={global_batch} must be divisible by the number of processes ({process_count})")
        if isinstance(source, np.ndarray):
            source = Windows([source], seq_len)
        if not isinstance(source, grain.MapDataset):
            source = grain.MapDataset.source(source)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.seed = seed
        self.process_index = process_index
        self.samples = source.shuffle(seed=seed % 2**32) if shuffle else source
        self.read_ahead = read_ahead
        self.name = name
        self.step = 0
        self._iter = None

    def batch_at(self, step: int) -> np.ndarray:
        """This process's rows of global batch ``step``."""
        first = step * self.global_batch + self.process_index * self.local_batch
        return np.stack([self.samples[i] for i in range(first, first + self.local_batch)])

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self.read_ahead < 1:
            batch = self.batch_at(self.step)
        else:
            if self._iter is None:
                steps = grain.MapDataset.range(self.step, 2**62).map(self.batch_at)
                options = grain.ReadOptions(num_threads=min(self.read_ahead, 2), prefetch_buffer_size=self.read_ahead)
                self._iter = iter(steps.to_iter_dataset(options))
            batch = next(self._iter)
        self.step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch, "name": self.name}

    def check_state(self, state: dict) -> None:
        """Raises `ValueError` naming the first setting of a checkpointed ``state`` that differs from this pipeline's."""
        for key in ("seed", "seq_len", "global_batch", "name"):
            if state.get(key, getattr(self, key)) != getattr(self, key):  # checkpoints before "name" lack it
                raise ValueError(
                    f"checkpointed data state has {key}={state[key]} but this run has {getattr(self, key)}; "
                    "resume with the original data settings or use a fresh workdir"
                )

    def set_state(self, state: dict) -> None:
        self.check_state(state)
        self.step = int(state["step"])
        self._iter = None


def leading_tokens(
    source: Windows, batch_size: int, tokens: int, *, process_index: int = 0, process_count: int = 1
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The split's first ``tokens`` targets exactly (modded-nanogpt's fixed 10,485,760), as windows in order
    in batches of ``batch_size``, and per batch a ``(rows, seq_len)`` float32 weight per target: 1 for the
    requested targets, 0 for the rest of the last window and for the rows that pad the last batch (copies
    of window 0). The weighted mean of the per-target losses is then the mean over exactly ``tokens``.

    Raises:
      ValueError: the split holds fewer than ``tokens`` targets in whole windows.
    """
    seq_len = source.seq_len
    needed = -(-tokens // seq_len)
    if tokens < 1 or len(source) < needed:
        raise ValueError(
            f"data.val_tokens={tokens} needs {needed} validation windows of {seq_len + 1} tokens, the split has {len(source)}; "
            "use more validation data or fewer data.val_tokens"
        )
    rows = -(-needed // batch_size) * batch_size
    weights = (np.arange(rows * seq_len) < tokens).astype(np.float32).reshape(rows, seq_len)
    picks = np.where(np.arange(rows) < needed, np.arange(rows), 0).reshape(-1, batch_size)
    local = slice(process_index * (batch_size // process_count), (process_index + 1) * (batch_size // process_count))
    batches = [np.stack([source[int(w)] for w in row[local]]) for row in picks]
    return batches, [w[local] for w in weights.reshape(-1, batch_size, seq_len)]


def validation_batches(
    source: Windows | np.ndarray,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
    leading: bool = False,
) -> list[np.ndarray]:
    """A fixed held-out set: ``num_batches`` batches of windows spread evenly over the validation split,
    or with ``leading`` its first windows in order (the same leading tokens for any batch size, as
    modded-nanogpt's fixed validation tokens).

    When the split holds fewer windows than requested, the number of batches shrinks to fit.

    Raises:
      ValueError: the split is shorter than one window per row of a batch.
    """
    windows = Windows([source], seq_len) if isinstance(source, np.ndarray) else source
    num_batches = min(num_batches, len(windows) // batch_size)
    if num_batches < 1:
        raise ValueError(
            f"the validation split has {len(windows)} windows of {seq_len + 1} tokens, too few for one batch of "
            f"{batch_size}; raise data.val_fraction, use more validation data, or lower batch_size / data.seq_len"
        )
    count = num_batches * batch_size
    picks = (np.arange(count) if leading else np.linspace(0, len(windows) - 1, count).astype(np.int64)).reshape(num_batches, batch_size)
    local = batch_size // process_count
    return [np.stack([windows[int(w)] for w in row[process_index * local : (process_index + 1) * local]]) for row in picks]
