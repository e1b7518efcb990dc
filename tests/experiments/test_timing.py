"""experiments.timing: a sample is several calls issued back to back, waited for once."""

import pytest

from experiments import timing


def test_a_sample_times_back_to_back_calls_and_waits_once(monkeypatch):
    clock, waits, calls = [0.0], [], []

    def fn():  # one call takes 1 ms of a fake clock
        calls.append(1)
        clock[0] += 1e-3
        return len(calls)

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda x: waits.append(x) or x)
    seconds = timing.time_calls(fn, warmup=1, iters=3, min_sample_s=0.02)
    assert seconds == pytest.approx([1e-3] * 3)  # per call, not per sample
    assert len(calls) == 1 + 3 * 20  # the warm-up's 1 ms sets 20 calls per sample of 20 ms
    assert waits == [1, 21, 41, 61]  # one wait per warm-up call and per sample, on its last call


def test_without_warmup_each_sample_is_one_call():
    calls = []
    seconds = timing.time_calls(lambda: calls.append(1), warmup=0, iters=2)
    assert len(seconds) == 2 and len(calls) == 2
