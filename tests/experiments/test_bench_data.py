"""experiments.bench_data at toy sizes: synthetic shards read back, the loader is timed, the table prints."""

from experiments import bench_data
from lm.data import shards


def test_loader_speed_from_synthetic_shards_and_table(tmp_path, capsys):
    paths = bench_data.synthetic_shards(tmp_path, 25_000_000 // 1000)
    streams = [shards.read(p) for p in paths]
    assert sum(map(len, streams)) == 25_000 and max(int(s.max()) for s in streams) < bench_data.GPT2_VOCAB
    speed = bench_data.loader_speed(streams, batch=4, seq_len=64, batches=5, read_ahead=2)
    assert speed > 0
    bench_data.print_table([{"row": "loader", "case": "x", "value": speed, "unit": "tokens/s", "detail": "d"},
                            {"row": "input_wait", "case": "y", "value": 0.0123, "unit": "share of step time", "detail": "e"}])  # fmt: skip
    out = capsys.readouterr().out
    assert "| loader | x |" in out and "| 1.23% |" in out
