"""Tokenizers from local files (built here, never downloaded) behind `lm.data.tokenizer.load`, and the offline BPE trainer."""

import base64
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lm.data import tokenizer

REPO = Path(__file__).resolve().parents[3]
TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + the_value  # the comment {i}\n\n" for i in range(200))
SAMPLE = "def the_value(x):\n    return x * 3  # ünïcode ✓\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    hf = tokenizer.train_bpe([TEXT], 320, root / "hf")

    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.split("\n\n") * 3), model_prefix=str(root / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )  # fmt: skip

    merges = [b"th", b"the", b"de", b"def", b" x", b"re", b"ret"]
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate([bytes([b]) for b in range(256)] + merges)]
    (root / "ranks.tiktoken").write_text("\n".join(lines) + "\n")
    return {"hf": str(hf), "sp": str(root / "sp.model"), "tiktoken": str(root / "ranks.tiktoken")}


def test_bytes_is_the_default_and_matches_the_module_functions():
    tok = tokenizer.load()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.separator_id) == (259, 256, 257, 257)
    np.testing.assert_array_equal(tok.encode(SAMPLE), tokenizer.encode(SAMPLE))
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.token_dtype == np.uint16


@pytest.mark.parametrize("kind", ["hf", "sp", "tiktoken"])
def test_file_tokenizers_round_trip_and_compress(files, kind):
    tok = tokenizer.load(files[kind])
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert 0 < len(ids) < len(SAMPLE.encode())  # merges were applied
    assert int(ids.max()) < tok.vocab_size
    assert tok.separator_id is not None and tok.separator_id < tok.vocab_size
    assert len(tok.fingerprint) == 64


def test_tokenizer_specifics(files):
    hf = tokenizer.load(files["hf"])
    assert hf.vocab_size == 320 and hf.eos_id == hf.separator_id == 0  # <|endoftext|> is the first id
    assert tokenizer.load(str(Path(files["hf"]).parent)).fingerprint == hf.fingerprint  # a folder finds tokenizer.json
    sp = tokenizer.load(files["sp"])
    assert (sp.vocab_size, sp.bos_id, sp.eos_id) == (400, 1, 2)
    tt = tokenizer.load(files["tiktoken"])
    assert tt.vocab_size == 256 + 7 + 1 and tt.eos_id == 263
    assert list(tt.encode("the")) == [257] and list(tt.encode("def")) == [259]


def test_bad_tokenizer_files_name_the_file(tmp_path, files):
    with pytest.raises(tokenizer.TokenizerError, match="nope.json.*does not exist"):
        tokenizer.load(str(tmp_path / "nope.json"))
    (tmp_path / "vocab.txt").write_text("x")
    with pytest.raises(tokenizer.TokenizerError, match="vocab.txt.*unknown kind"):
        tokenizer.load(str(tmp_path / "vocab.txt"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(tokenizer.TokenizerError, match="tokenizer.json is not a Hugging Face"):
        tokenizer.load(str(tmp_path / "tokenizer.json"))
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(tokenizer.TokenizerError, match="bad.model is not a SentencePiece"):
        tokenizer.load(str(tmp_path / "bad.model"))
    (tmp_path / "bad.tiktoken").write_text("QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(tokenizer.TokenizerError, match="bad.tiktoken line 2"):
        tokenizer.load(str(tmp_path / "bad.tiktoken"))
    (tmp_path / "gap.tiktoken").write_text("QQ== 0\nQg== 2\n")
    with pytest.raises(tokenizer.TokenizerError, match="without gaps"):
        tokenizer.load(str(tmp_path / "gap.tiktoken"))


def test_train_tokenizer_cli_on_given_text_and_bad_flags(tmp_path):
    text = tmp_path / "in.jsonl"
    text.write_text("\n".join(f'{{"text": "document number {i} says hello world"}}' for i in range(300)))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "experiments.train_tokenizer", *args], cwd=REPO, capture_output=True, text=True, check=False)

    done = run("--vocab_size=300", f"--out={tmp_path / 'tok'}", f"--input={text}")
    assert done.returncode == 0, done.stderr[-2000:]
    tok = tokenizer.load(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.vocab_size == 300 and len(tok.encode("hello world")) < 5
    empty = run(f"--out={tmp_path / 'x'}", f"--input={tmp_path / 'none*.txt'}")
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "matches no files" in empty.stderr
    nothing = run("--max_bytes=0", f"--out={tmp_path / 'y'}", f"--input={text}")  # trained on one document before
    assert nothing.returncode == 2 and "--max_bytes=0 must be >= 1" in nothing.stderr and not (tmp_path / "y").exists()
    with pytest.raises(ValueError, match="--vocab_size=100 must be at least 257"):
        tokenizer.train_bpe(["text"], 100, tmp_path / "small")
    with pytest.raises(ValueError, match=r"tok/tokenizer.json exists and is not written over"):  # was: replaced, unlike the shards' --out
        tokenizer.train_bpe(["text"], 300, tmp_path / "tok")
    assert tokenizer.load(str(tmp_path / "tok" / "tokenizer.json")).fingerprint == tok.fingerprint


def test_the_tokenizers_text_budget_counts_utf8_bytes():
    from experiments import train_tokenizer

    texts = ["ab", "éé", "c", "d"]  # 2, 4, 1, 1 bytes; 2, 2, 1, 1 characters
    assert list(train_tokenizer._budgeted(texts, 6)) == ["ab", "éé"]
    assert list(train_tokenizer._budgeted(texts, 7)) == ["ab", "éé", "c"]


def test_a_run_finds_the_tokenizer_its_shards_were_written_with(files, tmp_path):
    """`input_pipeline.run_tokenizer` (what `experiments.sample` decodes with): bytes for the text corpus, the
    manifest's tokenizer for shards, refused when the file changed since the shards were written."""
    from lm.data import documents, input_pipeline, tokenize

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(TEXT)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes(Path(files["hf"]).read_bytes())
    spec = str(tok_dir / "tokenizer.json")
    tokenize.tokenize(spec, documents.expand(str(tmp_path / "text")), tmp_path / "shards", val_fraction=0.0, shard_tokens=10_000, workers=1)
    data = input_pipeline.DataConfig()
    assert input_pipeline.run_tokenizer(data).name == "bytes"
    data = dataclasses.replace(data, train_files=str(tmp_path / "shards" / "train_*.bin"))
    tok = input_pipeline.run_tokenizer(data)
    assert tok.fingerprint == tokenizer.load(files["hf"]).fingerprint and tok.decode(tok.encode(SAMPLE)) == SAMPLE
    other = tokenizer.train_bpe([TEXT], 300, tmp_path / "other")  # a different, valid tokenizer at that path
    (tok_dir / "tokenizer.json").write_bytes(Path(other).read_bytes())
    with pytest.raises(ValueError, match="tokenizer.json is not the tokenizer the shards were written with"):
        input_pipeline.run_tokenizer(data)
