import os

import numpy as np
import pytest

from lm.data import corpus, batches, tokenizer


def _write_tree(root, n_files=40):
    for i in range(n_files):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.txt").write_text(f"# file {i}\n" + "x = 1\n" * (i + 1))
    (root / ".hidden").mkdir(exist_ok=True)
    (root / ".hidden" / "skip.txt").write_text("never read")
    (root / "blob.bin").write_bytes(b"\0\1\2" * 10)


def test_folder_corpus_split_is_a_stable_hash_of_paths(tmp_path):
    root = tmp_path / "text"
    _write_tree(root)
    streams = corpus.load(str(root), val_fraction=0.3, cache_dir=tmp_path / "cache")
    files = corpus.list_documents(root, python_only=False)
    assert len(files) == 40  # hidden folders and binary files are skipped
    expected = {"train": [], "validation": []}
    for f in files:
        split = "validation" if corpus.is_validation(f.relative_to(root).as_posix(), 0.3) else "train"
        expected[split] += list(tokenizer.encode(f.read_bytes())) + [tokenizer.EOS]
    assert expected["validation"] and expected["train"]
    for split in corpus.SPLITS:
        np.testing.assert_array_equal(streams[split], expected[split])
        assert isinstance(streams[split], np.memmap)


def test_corpus_cache_is_reused_and_invalidated_by_edits(tmp_path):
    root = tmp_path / "text"
    _write_tree(root, 10)
    cache = tmp_path / "cache"
    corpus.load(str(root), val_fraction=0.5, cache_dir=cache)
    built = sorted(cache.iterdir())
    assert len(built) == 1
    corpus.load(str(root), val_fraction=0.5, cache_dir=cache)
    assert sorted(cache.iterdir()) == built
    target = root / "pkg0" / "mod0.txt"
    target.write_text("changed")
    os.utime(target, ns=(1, 1))
    corpus.load(str(root), val_fraction=0.5, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2


def test_single_file_corpus_holds_out_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("abcdefghij" * 100)
    streams = corpus.load(str(path), val_fraction=0.1, cache_dir=tmp_path / "cache")
    assert len(streams["train"]) == 901 and len(streams["validation"]) == 101
    assert tokenizer.decode(streams["validation"][:-1]) == "abcdefghij" * 10


def test_a_folder_whose_files_all_fall_in_one_split_names_the_fix(tmp_path):
    """Was: training stopped at 'validation split: 0 tokens ... use more data or a smaller data.seq_len'."""
    root = tmp_path / "text"
    _write_tree(root, 3)
    paths = [f.relative_to(root).as_posix() for f in corpus.list_documents(root, python_only=False)]
    assert not any(corpus.is_validation(p, 0.02) for p in paths) and all(corpus.is_validation(p, 0.999) for p in paths)
    with pytest.raises(ValueError, match=r"none of the 3 files under data.path .* fell in the validation split .*; raise data.val_fraction"):
        corpus.load(str(root), val_fraction=0.02, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"fell in the train split .*; lower data.val_fraction or add files"):
        corpus.load(str(root), val_fraction=0.999, cache_dir=tmp_path / "cache")


def test_missing_path_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.load(str(tmp_path / "nope"), cache_dir=tmp_path)


def test_binary_files_and_document_records_are_refused_naming_the_tokenizer(tmp_path):
    """A single binary file (a Parquet table, say) was trained on as its raw bytes, and JSONL as its JSON syntax:
    data.path reads a file's bytes as one document. A folder's binary files are skipped, as before."""
    (tmp_path / "table.parquet").write_bytes(b"PAR1\0\1\2" * 100)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "one"}\n' * 50)
    (tmp_path / "docs" / "b.txt").write_text("plain text\n" * 50)
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "x.bin").write_bytes(b"\0" * 10)
    tokenize = r"go through python -m experiments.tokenize --input=PATH --out=DIR"
    with pytest.raises(ValueError, match=rf"table.parquet' is not a text file \(it holds NUL bytes\); .*{tokenize}"):
        corpus.load(str(tmp_path / "table.parquet"), cache_dir=tmp_path / "cache")
    for path in (tmp_path / "docs", tmp_path / "docs" / "a.jsonl"):
        with pytest.raises(ValueError, match=rf"a.jsonl' \(1 such file\(s\)\) holds records .*{tokenize}"):
            corpus.load(str(path), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=rf"no text files under .*blobs' \(files holding NUL bytes are skipped\); .*{tokenize}"):
        corpus.load(str(tmp_path / "blobs"), cache_dir=tmp_path / "cache")


def test_stdlib_corpus_is_python_source():
    streams = corpus.load("", val_fraction=0.02)
    assert len(streams["train"]) > 5_000_000
    assert 0.005 < len(streams["validation"]) / len(streams["train"]) < 0.05
    assert "import" in tokenizer.decode(streams["train"][:20000])
    assert int(np.max(streams["train"])) == tokenizer.EOS


def _stream(n=10_000):
    return np.arange(n, dtype=np.uint16) % 251


def test_batches_are_packed_windows_with_shifted_targets():
    it = batches.PackedBatches(_stream(), seq_len=16, global_batch=4, seed=0)
    batch = next(it)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    for row in batch:
        start = row[0]
        np.testing.assert_array_equal(row, (np.arange(start, start + 17)) % 251)  # contiguous window


def test_batches_are_deterministic_and_seeded():
    a = [next(batches.PackedBatches(_stream(), 16, 4, seed=3)) for _ in range(1)]
    b = [next(batches.PackedBatches(_stream(), 16, 4, seed=3)) for _ in range(1)]
    c = [next(batches.PackedBatches(_stream(), 16, 4, seed=4)) for _ in range(1)]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_resume_from_state_continues_exactly():
    it = batches.PackedBatches(_stream(), 16, 4, seed=1)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    resumed = batches.PackedBatches(_stream(), 16, 4, seed=1)
    resumed.set_state(state)
    np.testing.assert_array_equal([next(resumed) for _ in range(3)], expected)
    with pytest.raises(ValueError, match="global_batch"):
        batches.PackedBatches(_stream(), 16, 8, seed=1).set_state(state)


def test_process_shares_tile_the_global_batch():
    full = batches.PackedBatches(_stream(), 16, 8, seed=2).batch_at(7)
    shares = [batches.PackedBatches(_stream(), 16, 8, seed=2, process_index=i, process_count=4).batch_at(7) for i in range(4)]
    np.testing.assert_array_equal(np.concatenate(shares), full)


def test_an_epoch_visits_every_window_once():
    it = batches.PackedBatches(_stream(16 * 12 + 1), 16, 4, seed=0)
    starts = np.concatenate([it.batch_at(s)[:, 0] for s in range(3)])
    assert sorted(starts.tolist()) == sorted(((np.arange(12) * 16) % 251).tolist())


def test_validation_set_is_fixed_and_shrinks_to_fit():
    stream = _stream(2000)
    a = batches.validation_batches(stream, 16, 4, 100)
    assert len(a) == (1999 // 16) // 4
    np.testing.assert_array_equal(a, batches.validation_batches(stream, 16, 4, 100))
    with pytest.raises(ValueError, match="val_fraction"):
        batches.validation_batches(stream[:40], 16, 4, 1)
