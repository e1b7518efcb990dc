"""llm.c `.bin` / `.npy` shards (`lm.data.shards`), `lm.data.tokenize`, and windows over several shards (`lm.data.batches`)."""

import base64
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm.data import batches, documents, input_pipeline, shards, tokenize, tokenizer

REPO = Path(__file__).resolve().parents[3]


def test_bin_shard_layout_is_llm_c(tmp_path):
    tokens = np.array([0, 1, 50256, 65535], np.uint16)
    shards.write(tmp_path / "a.bin", tokens)
    raw = (tmp_path / "a.bin").read_bytes()
    header = np.frombuffer(raw[:1024], "<i4")
    assert len(raw) == 1024 + 2 * 4 and list(header[:3]) == [20240520, 1, 4] and not header[3:].any()
    np.testing.assert_array_equal(np.frombuffer(raw[1024:], "<u2"), tokens)
    read = shards.read(tmp_path / "a.bin")
    assert isinstance(read, np.memmap)
    np.testing.assert_array_equal(read, tokens)


def test_version_2_holds_large_ids_and_npy_shards_read(tmp_path):
    big = np.array([3, 70_000, 151_000], np.uint32)
    assert shards.version_for(65_536) == 1 and shards.version_for(65_537) == 2
    with pytest.raises(shards.ShardError, match="do not fit version 1"):
        shards.write(tmp_path / "v1.bin", big)
    shards.write(tmp_path / "v2.bin", big, version=2)
    assert list(np.fromfile(tmp_path / "v2.bin", "<i4", count=3)) == [20240520, 2, 3]
    np.testing.assert_array_equal(shards.read(tmp_path / "v2.bin"), big)
    np.save(tmp_path / "t.npy", big.astype(np.int64))
    np.testing.assert_array_equal(shards.read(tmp_path / "t.npy"), big)


def test_bad_shards_are_one_line_naming_the_file(tmp_path):
    shards.write(tmp_path / "ok.bin", np.arange(100, dtype=np.uint16))
    raw = (tmp_path / "ok.bin").read_bytes()
    cases = {
        "short.bin": (raw[:500], "fewer than the 1024-byte"),
        "magic.bin": (b"\x01" + raw[1:], "not the llm.c magic"),
        "cut.bin": (raw[:-10], "is truncated: the header promises 100 tokens"),
        "long.bin": (raw + b"\0\0", "longer than its header says"),
        "version.bin": (raw[:4] + np.int32(7).tobytes() + raw[8:], "header version 7"),
        "tokens.txt": (raw, "neither an llm.c .bin"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(shards.ShardError, match=message) as info:
            shards.read(tmp_path / name)
        assert name in str(info.value) and "\n" not in str(info.value)
    np.save(tmp_path / "2d.npy", np.zeros((2, 2), np.int32))
    with pytest.raises(shards.ShardError, match="2d.npy .*1-D integers"):
        shards.read(tmp_path / "2d.npy")
    with pytest.raises(shards.ShardError, match="ok.bin holds token id 99, outside the model's vocabulary of 64"):
        shards.check_vocab(shards.read(tmp_path / "ok.bin"), f"shard {tmp_path / 'ok.bin'}", 64)
    shards.check_vocab(shards.read(tmp_path / "ok.bin"), "ok.bin", 100)


DOCS = [f"document {i}: " + "word " * (i % 7 + 1) + "ünï ✓" for i in range(60)]


def _inputs(root):
    root.mkdir()
    (root / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in DOCS[:30]) + "\n")
    pq.write_table(pa.table({"text": DOCS[30:50], "id": list(range(20))}), root / "b.parquet")
    for i, text in enumerate(DOCS[50:]):
        (root / f"c{i}.txt").write_text(text)
    return documents.expand(str(root))


def test_tokenize_writes_shards_split_by_document_hash_and_a_manifest(tmp_path):
    files = _inputs(tmp_path / "in")
    assert len(files) == 12
    manifest = tokenize.tokenize("bytes", files, tmp_path / "out", val_fraction=0.3, shard_tokens=500, workers=1)
    val_docs = [t for t in DOCS if tokenize.is_validation(t, 0.3)]
    assert 0 < len(val_docs) < len(DOCS)
    decoded = {}
    for split in ("train", "val"):
        info = manifest["splits"][split]
        streams = [shards.read(tmp_path / "out" / name) for name in info["files"]]
        assert all(len(s) == 500 for s in streams[:-1]) and sum(map(len, streams)) == info["tokens"]
        stream = np.concatenate(streams)
        assert stream[0] == tokenizer.EOS and info["documents"] == int((stream == tokenizer.EOS).sum())
        decoded[split] = [bytes(stream[s + 1 : e].astype(np.uint8)).decode() for s, e in zip(*_bounds(stream))]
        assert info["bytes"] == sum(len(t.encode()) for t in decoded[split])
    assert sorted(decoded["val"]) == sorted(val_docs)
    assert sorted(decoded["train"] + decoded["val"]) == sorted(DOCS)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    assert (manifest["vocab_size"], manifest["separator_id"], manifest["version"]) == (259, 257, 1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")) == []  # staging removed


def _bounds(stream):
    starts = np.flatnonzero(stream == tokenizer.EOS)
    return starts, np.append(starts[1:], len(stream))


def test_tokenize_refuses_to_overwrite_and_keeps_what_exists(tmp_path):
    files = _inputs(tmp_path / "in")
    tokenize.tokenize("bytes", files, tmp_path / "out", val_fraction=0.1, shard_tokens=10_000, workers=1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(ValueError, match="already holds manifest.json"):
        tokenize.tokenize("bytes", files, tmp_path / "out", val_fraction=0.1, shard_tokens=10_000, workers=1)
    (tmp_path / "in" / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2"):
        tokenize.tokenize("bytes", documents.expand(str(tmp_path / "in")), tmp_path / "other", val_fraction=0.1, shard_tokens=10, workers=1)
    assert [p.name for p in (tmp_path / "other").iterdir()] == []  # nothing half-written
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    with pytest.raises(ValueError, match="--workers=-1 must be >= 0"):  # was multiprocessing's, naming no flag
        tokenize.tokenize("bytes", files, tmp_path / "third", val_fraction=0.1, shard_tokens=10_000, workers=-1)
    # one plain text file is one document, which the hash put in train (was: no val shard, and training then
    # refused data.val_files, matching no file)
    (tmp_path / "one.txt").write_text("def f(x):\n    return x\n" * 50)
    with pytest.raises(ValueError, match=r"none of the input's 1 documents fell in the validation split .*--val_fraction=0 for"):
        tokenize.tokenize("bytes", [tmp_path / "one.txt"], tmp_path / "fourth", val_fraction=0.1, shard_tokens=10_000, workers=1)
    assert not (tmp_path / "fourth" / "manifest.json").exists()


def test_tokenize_cli_with_a_subword_tokenizer_and_usage_errors(tmp_path):
    _inputs(tmp_path / "in")
    pieces = [bytes([b]) for b in range(256)] + [b" w", b" wo", b" wor", b" word"]
    ranks = tmp_path / "r.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(p).decode()} {rank}\n" for rank, p in enumerate(pieces)))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "experiments.tokenize", *args], cwd=REPO, capture_output=True, text=True, check=False)

    done = run(f"--tokenizer={ranks}", f"--input={tmp_path / 'in'}/*.jsonl", f"--out={tmp_path / 'out'}", "--workers=2", "--val_fraction=0.2")
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["vocab_size"] == 261 and manifest["separator_id"] == 260 and len(manifest["tokenizer_sha256"]) == 64
    tokens = np.concatenate([shards.read(tmp_path / "out" / f) for s in manifest["splits"].values() for f in s["files"]])
    assert (tokens == 259).sum() == sum(t.count(" word") for t in DOCS[:30])
    again = run(f"--input={tmp_path / 'in'}", f"--out={tmp_path / 'out'}")
    assert again.returncode == 2 and again.stderr.startswith("error: --out=") and again.stderr.count("\n") == 1


def test_windows_span_shards_and_align_to_documents():
    a, b = np.arange(50, dtype=np.uint16), np.arange(100, 133, dtype=np.uint16)
    windows = batches.Windows([a, b], 8)
    assert len(windows) == 6 + 4
    np.testing.assert_array_equal(windows[6], np.arange(100, 109))
    starts = batches.document_starts(np.array([5, 1, 1, 5, 1, 1, 1, 1, 1, 5, 1, 1, 1, 1]), 3, separator_id=5)
    assert starts.tolist() == [0, 3, 6, 9]  # a 6-token document is read in two windows, no window crosses the end
    it = batches.PackedBatches(windows, 8, 5, seed=4, read_ahead=2)
    epoch = np.concatenate([next(it) for _ in range(2)])
    assert sorted(epoch[:, 0].tolist()) == sorted(windows[i][0] for i in range(10))  # every window once per epoch
    assert not np.array_equal(np.concatenate([next(it) for _ in range(2)]), epoch)  # reshuffled


def test_too_little_data_names_the_split_that_holds_no_window(tmp_path):
    """A validation split shorter than one window (1% of a few documents) names its files (was: "the token streams")."""
    shards.write(tmp_path / "train_0.bin", np.arange(100, dtype=np.uint16))
    shards.write(tmp_path / "val_0.bin", np.arange(12, dtype=np.uint16))
    data = input_pipeline.DataConfig(seq_len=16, train_files=str(tmp_path / "train_*.bin"), val_files=str(tmp_path / "val_*.bin"))
    with pytest.raises(ValueError, match=r"^data.val_files=.*val_\*.bin: 12 tokens, not one window of seq_len \+ 1 = 17; use more data"):
        input_pipeline.build(data, 128, seed=0, batch_size=2, eval_batches=1)
    with pytest.raises(ValueError, match=r"^data.train_files=.*train_\*.bin: 100 tokens, not one window of seq_len \+ 1 = 129"):
        input_pipeline.build(dataclasses.replace(data, seq_len=128), 128, seed=0, batch_size=2, eval_batches=1)


def test_training_and_validation_shards_of_different_tokenizers_are_refused(tmp_path):
    """Byte-level validation shards beside subword training shards (was: validated silently, loss 7.2 at step 4)."""
    for split, tokenizer_name, sha in (("train", "bpe.json", "a" * 64), ("val", "bytes", "b" * 64)):
        (tmp_path / split).mkdir()
        shards.write(tmp_path / split / f"{split}_0.bin", np.arange(100, dtype=np.uint16))
        manifest = {"vocab_size": 128, "tokenizer": tokenizer_name, "tokenizer_sha256": sha}
        (tmp_path / split / "manifest.json").write_text(json.dumps(manifest))
    data = input_pipeline.DataConfig(seq_len=16, train_files=str(tmp_path / "train/*.bin"), val_files=str(tmp_path / "val/*.bin"))
    with pytest.raises(ValueError, match=r"made with different tokenizers \(data.train_files=.* with bpe.json; data.val_files=.* with bytes\)"):
        input_pipeline.build(data, 128, seed=0, batch_size=2, eval_batches=1)
    (tmp_path / "val" / "manifest.json").write_text(json.dumps({"vocab_size": 128, "tokenizer": "bpe.json", "tokenizer_sha256": "a" * 64}))
    input_pipeline.build(data, 128, seed=0, batch_size=2, eval_batches=1)
    # two folders in one glob list (was: only the first folder's manifest was read)
    (tmp_path / "more").mkdir()
    shards.write(tmp_path / "more" / "train_1.bin", np.arange(100, dtype=np.uint16))
    (tmp_path / "more" / "manifest.json").write_text(json.dumps({"vocab_size": 128, "tokenizer": "bytes", "tokenizer_sha256": "b" * 64}))
    both = dataclasses.replace(data, train_files=f"{tmp_path / 'train/*.bin'},{tmp_path / 'more/*.bin'}")
    with pytest.raises(ValueError, match=r"different tokenizers \(data.train_files in \S*more with bytes; data.train_files in \S*train with bpe.json\)"):
        input_pipeline.build(both, 128, seed=0, batch_size=2, eval_batches=1)
    for folder, vocab_size in (("more", 128), ("train", 300)):
        (tmp_path / folder / "manifest.json").write_text(json.dumps({"vocab_size": vocab_size, "tokenizer": "bpe.json", "tokenizer_sha256": "a" * 64}))
    assert input_pipeline.manifest_vocab_size(both) == 384  # the largest of every folder's (was: the first's, more's 128)


def test_the_model_vocabulary_comes_from_the_shards_manifest_once_they_exist(tmp_path):
    """A plan made before the data is fetched (`experiments.plan` of the speedrun) keeps the model's vocabulary
    (was: "matches no files"); reading missing shards still names them."""
    data = input_pipeline.DataConfig(train_files=str(tmp_path / "train_*.bin"), val_files=str(tmp_path / "val_*.bin"))
    assert input_pipeline.manifest_vocab_size(data) is None
    with pytest.raises(documents.DocumentError, match="train_files=.*train_\\*.bin' matches no files"):
        input_pipeline.build(data, 128, seed=0, batch_size=2, eval_batches=1)
    shards.write(tmp_path / "train_0.bin", np.arange(300, dtype=np.uint16))
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab_size": 300}))
    assert input_pipeline.manifest_vocab_size(data) == 384  # padded to a multiple of 128
