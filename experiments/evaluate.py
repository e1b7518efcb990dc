r"""Evaluates a training run's checkpoint or a transformers checkpoint: bits per byte and multiple choice.

    python -m experiments.evaluate --workdir=runs/tiny                       # the run's validation set
    python -m experiments.evaluate --workdir=runs/tiny --text=notes.txt --tasks=hellaswag.jsonl,arc.jsonl
    python -m experiments.evaluate --hf=exports/tiny --tasks=tests/data/eval/synthetic_choice.jsonl
    python -m experiments.evaluate --hf=exports/bpe --val_files='data/stdlib-bpe8k/val_*.bin'

Bits per byte: of the run's fixed validation set (`lm.data.input_pipeline`, as training reports it), of
held-out token shards (``--val_files``; tokens per byte from their ``manifest.json``), or of a text
file (``--text``): the file is one document, tokenized after a separator so every token is predicted
once, in windows of ``--seq_len``:  ``bpb = sum_t -log2 p(x_t | x_<t) / utf8_bytes``.

Multiple choice (``--tasks``): JSONL files, one question per line, ``{"context": str, "choices":
[str, ...], "label": int}``, or HellaSwag's and ARC's released lines as they are (`_question`). Each choice
is scored by its log-likelihood after the context, ``sum_t log p(choice_t | context, choice_<t)``;
``acc`` picks the largest sum, ``acc_norm`` the largest sum per UTF-8 byte of the choice (the
length-normalised score). Accuracies come with their standard error ``sqrt(a (1 - a) / n)``.

Sequences are scored in batches of ``--batch_size`` rows sharded over the mesh's batch axes; the
parameters keep the run's shardings (``--mesh``, default every device data-parallel; on a laptop,
``--cpu_devices=N`` splits the CPU so an ``N``-device mesh runs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags

from experiments import cli, restore, trainer
from lm import hf
from lm import model as model_lib
from lm.data import documents, input_pipeline, shards, tokenizer
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

DEFAULT_MAX_TOKENS = 1 << 20  # tokens of --val_files scored when --max_tokens is not given


@dataclasses.dataclass(frozen=True)
class Scorer:
    """A model ready to score token rows: parameters placed on ``mesh`` by ``rules``."""

    model_def: model_lib.ModelDef
    params: model_lib.Params
    mesh: jax.sharding.Mesh
    rules: rules_lib.Rules
    tokenizer: tokenizer.Tokenizer

    @property
    def batch_shards(self) -> int:
        spec = rules_lib.logical_to_mesh_spec(("batch",), self.rules.activations, self.mesh.axis_names)
        axes = spec[0] if spec and spec[0] else ()
        return math.prod(self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))

    def log_likelihoods(self, rows: np.ndarray, mask: np.ndarray, batch_size: int) -> np.ndarray:
        """``sum_t mask[r, t] log p(rows[r, t] | rows[r, :t])`` per row, for ``rows`` ``(n, T)``, in batches."""
        n = rows.shape[0]
        batch_size = -(-batch_size // self.batch_shards) * self.batch_shards
        padded = -(-n // batch_size) * batch_size
        rows = np.pad(rows, ((0, padded - n), (0, 0)))
        mask = np.pad(mask, ((0, padded - n), (0, 0)))
        batch = jax.NamedSharding(self.mesh, rules_lib.logical_to_mesh_spec(("batch", None), self.rules.activations, self.mesh.axis_names))
        score = _score_fn(self.model_def, batch)
        out = []
        with jax.set_mesh(self.mesh), partition.use_rules(self.rules):
            for start in range(0, padded, batch_size):
                chunk = [jax.device_put(a[start : start + batch_size], batch) for a in (rows, mask)]
                out.append(np.asarray(score(self.params, *chunk)))
        return np.concatenate(out)[:n]


def _score_fn(model_def: model_lib.ModelDef, batch: jax.NamedSharding) -> Callable:
    def score(params, rows, mask):
        logits = model_lib.apply(model_def, params, rows[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(picked * mask[:, 1:], axis=-1)

    return jax.jit(score, in_shardings=(None, batch, batch))


# ------------------------------------------------------------------------------------ loading


def from_run(workdir: str | Path, step: int | None = None, mesh: str = "", tokenizer_spec: str = "") -> tuple[Scorer, ml_collections.ConfigDict]:
    """A `Scorer` of the run in ``workdir`` (its tokenizer from its shards' manifest), and the run's config."""
    spec, params, _ = restore.restore_run(workdir, step, mesh=mesh, devices=0)
    tok = restore.load_tokenizer(workdir, tokenizer_spec)
    config = ml_collections.ConfigDict(json.loads((Path(workdir) / "config.json").read_text()))
    return Scorer(spec.model_def, params, spec.mesh, spec.rules, tok), config


def from_hf(directory: str | Path, mesh: str = "", tokenizer_spec: str = "") -> Scorer:
    """A `Scorer` of a transformers checkpoint; its tokenizer file (`tokenizer.find_in`) unless ``tokenizer_spec``
    names one (else bytes)."""
    directory = Path(directory)
    device_mesh = mesh_lib.make_mesh(mesh)
    rules = rules_lib.make_rules("fsdp")
    try:
        model_def, params = hf.load_model(directory, device_mesh, rules)
    except (hf.CheckpointError, FileNotFoundError) as e:
        raise cli.UsageError(str(e)) from e
    default = tokenizer.find_in(directory) or "bytes"
    return Scorer(model_def, params, device_mesh, rules, tokenizer.load(tokenizer_spec or str(default)))


# ------------------------------------------------------------------------------------ bits per byte


def text_bits_per_byte(scorer: Scorer, text: str, *, seq_len: int, batch_size: int) -> float:
    """Bits per UTF-8 byte of ``text``, one document after a separator, scored in windows of ``seq_len``."""
    tok = scorer.tokenizer
    if tok.separator_id is None:
        raise cli.UsageError(f"tokenizer {tok.name} has no separator (EOS or BOS) to open the text with")
    stream = np.concatenate([[tok.separator_id], tok.encode(text)]).astype(np.int32)
    n_windows = max(1, -(-(len(stream) - 1) // seq_len))
    rows = np.zeros((n_windows, seq_len + 1), np.int32)
    mask = np.zeros_like(rows, dtype=np.float32)
    for w in range(n_windows):
        piece = stream[w * seq_len : w * seq_len + seq_len + 1]
        rows[w, : len(piece)] = piece
        mask[w, 1 : len(piece)] = 1.0  # each window predicts its tokens after the first
    nats = -float(np.sum(scorer.log_likelihoods(rows, mask, batch_size)))
    return nats / math.log(2) / max(1, len(text.encode("utf-8")))


def shards_bits_per_byte(scorer: Scorer, pattern: str, *, seq_len: int, batch_size: int, max_tokens: int = 0) -> dict:
    """Loss and bits per byte of held-out token shards (``.bin`` / ``.npy``, `lm.data.shards`), in disjoint windows
    of ``seq_len + 1`` tokens (the first ``max_tokens`` of them; 0: all). Bits per byte need the shards'
    ``manifest.json`` (the tokens per byte of the splits that list them: `lm.data.input_pipeline.tokens_per_byte`)."""
    try:
        files = documents.expand(pattern, what="--val_files")
        for folder, manifest in input_pipeline.folder_manifests(files).items():  # every folder's (was: the first's)
            if manifest is not None and manifest.get("tokenizer_sha256") not in (None, scorer.tokenizer.fingerprint):
                raise ValueError(
                    f"--val_files={pattern}: the shards in {folder} were tokenized with {manifest.get('tokenizer')}, not with "
                    f"this model's tokenizer ({scorer.tokenizer.name}): their ids would mean other text to it; tokenize the "
                    f"text with the model's (python -m experiments.tokenize --tokenizer={scorer.tokenizer.name} --input=... --out=...)"
                )
        streams = [shards.read(f) for f in files]
        for f, tokens in zip(files, streams, strict=True):
            shards.check_vocab(tokens, f"shard {f}", scorer.model_def.config.vocab_size, trained=True)
    except (ValueError, FileNotFoundError) as e:
        raise cli.UsageError(str(e)) from e
    width = seq_len + 1
    rows = np.concatenate([s[: len(s) // width * width].reshape(-1, width) for s in streams]).astype(np.int32)
    if max_tokens:
        rows = rows[: max(1, max_tokens // width)]
    if not len(rows):
        raise cli.UsageError(f"--val_files={pattern} holds fewer than seq_len + 1 = {width} tokens per file")
    sums = scorer.log_likelihoods(rows, np.ones(rows.shape, np.float32), batch_size)
    loss = -float(np.sum(sums)) / (rows.shape[0] * seq_len)
    per_byte = input_pipeline.tokens_per_byte(files)
    bpb = None if per_byte is None else loss / math.log(2) * per_byte
    return {"shards_loss": loss, "shards_bits_per_byte": bpb, "shards_tokens": int(rows.shape[0] * seq_len)}


def validation_bits_per_byte(scorer: Scorer, config: ml_collections.ConfigDict, batch_size: int) -> dict:
    """Loss and bits per byte of the run's fixed validation set (as training computes them)."""
    _, val_batches = trainer.load_data(config, scorer.model_def.config.vocab_size)
    rows = np.concatenate(list(val_batches)).astype(np.int32)
    weights = np.ones((len(rows), rows.shape[1] - 1), np.float32) if val_batches.weights is None else np.concatenate(val_batches.weights)
    sums = scorer.log_likelihoods(rows, np.pad(weights, ((0, 0), (1, 0))), batch_size)  # a weight per target: rows[:, 1:]
    loss = -float(np.sum(sums)) / float(np.sum(weights))
    return {"val_loss": loss, "val_bits_per_byte": val_batches.bits_per_byte(loss)}


# ------------------------------------------------------------------------------------ multiple choice


@dataclasses.dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]
    label: int


def _clean_hellaswag(text: str) -> str:
    """HellaSwag's WikiHow text without its artifacts, as lm-evaluation-harness cleans it: `` [title]`` becomes
    a sentence end, other ``[...]`` tags go, double spaces become one."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def _question(record: dict) -> Question:
    """One task line: ours, ``{context, choices, label}``; HellaSwag's released line (``ctx_a``, ``ctx_b``,
    ``activity_label``, ``endings``, ``label``); or ARC's (``question`` with ``stem`` and ``choices`` of ``text`` /
    ``label``, or the Hugging Face layout with ``question`` and ``choices: {text, label}``; ``answerKey``).
    HellaSwag and ARC are put as lm-evaluation-harness puts them, so accuracies compare with its tables:
    ``"{activity}: {ctx_a} {Ctx_b}"`` and each ending after a space; ``"Question: {q}\\nAnswer:"`` and each
    choice after a space."""
    if "context" in record:
        return Question(str(record["context"]), tuple(map(str, record["choices"])), int(record["label"]))
    if "endings" in record:
        if record["label"] == "":
            raise ValueError("no label: HellaSwag's test split has none, its validation split has")
        context = f"{record['activity_label']}: {record['ctx_a']} {record['ctx_b'].capitalize()}"
        return Question(_clean_hellaswag(context), tuple(" " + _clean_hellaswag(e) for e in record["endings"]), int(record["label"]))
    if "answerKey" in record:
        question = record["question"]
        if isinstance(question, dict):  # the released ARC-V1 files
            stem, texts, labels = question["stem"], [c["text"] for c in question["choices"]], [c["label"] for c in question["choices"]]
        else:  # the Hugging Face dataset's layout
            stem, texts, labels = question, record["choices"]["text"], record["choices"]["label"]
        if record["answerKey"] not in labels:
            raise ValueError(f"answerKey {record['answerKey']!r} is none of the choices' labels {list(labels)}")
        return Question(f"Question: {stem}\nAnswer:", tuple(f" {t}" for t in texts), list(labels).index(record["answerKey"]))
    raise KeyError("context (or HellaSwag's endings, or ARC's answerKey)")


def _read_utf8(path: Path, what: str) -> str:
    """The text of ``path``; a file that is not UTF-8 is one line naming ``what`` and the byte (was a traceback)."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        bad = e.object[e.start : e.start + 4]
        raise cli.UsageError(f"{what} is not UTF-8 (byte {e.start}: {bad!r}); convert it (e.g. iconv -f latin1 -t utf-8)") from e


def read_questions(path: str | Path) -> list[Question]:
    """The questions of a JSONL task file (`_question`'s layouts); a malformed line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        state = "is a folder" if path.is_dir() else "does not exist"
        raise cli.UsageError(f"task file {path} {state}; give a file of JSONL lines of {{context, choices, label}}, HellaSwag or ARC")
    questions = []
    for number, line in enumerate(_read_utf8(path, f"task file {path}").splitlines(), 1):
        if not line.strip():
            continue
        try:
            question = _question(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise cli.UsageError(
                f"{path} line {number} is not a {{context, choices, label}}, HellaSwag or ARC JSON object ({type(e).__name__}: {e})"
            ) from e
        if len(question.choices) < 2 or not 0 <= question.label < len(question.choices):
            raise cli.UsageError(f"{path} line {number}: needs >= 2 choices and a label in [0, {len(question.choices)})")
        questions.append(question)
    if not questions:
        raise cli.UsageError(f"task file {path} holds no questions")
    return questions


def _standard_error(accuracy: float, n: int) -> float:
    return math.sqrt(accuracy * (1 - accuracy) / n)


def multiple_choice(scorer: Scorer, questions: Sequence[Question], *, batch_size: int) -> dict:
    """``acc``, ``acc_norm`` (per UTF-8 byte of the choice), their standard errors, and ``n``.

    Each (context, choice) pair is one row: separator, context tokens, choice tokens, cut from the
    left to the model's ``max_seq_len``; only the choice's tokens are scored.
    """
    tok = scorer.tokenizer
    start = [] if tok.separator_id is None else [tok.separator_id]
    limit = scorer.model_def.config.max_seq_len + 1
    encoded, owners = [], []
    for q, question in enumerate(questions):
        context = tok.encode(question.context).tolist()
        for choice in question.choices:
            answer = tok.encode(choice).tolist()
            if not answer:
                raise cli.UsageError(f"question {q} has an empty choice")
            encoded.append(((start + context + answer)[-limit:], min(len(answer), limit - 1)))
            owners.append(q)
    length = max(len(row) for row, _ in encoded)
    length = min(limit, -(-length // 16) * 16)  # few distinct shapes, few compilations
    rows = np.zeros((len(encoded), length), np.int32)
    mask = np.zeros(rows.shape, np.float32)
    for r, (row, n_answer) in enumerate(encoded):
        rows[r, : len(row)] = row
        mask[r, len(row) - n_answer : len(row)] = 1.0
    sums = scorer.log_likelihoods(rows, mask, batch_size)
    owners = np.asarray(owners)
    correct = correct_norm = 0
    for q, question in enumerate(questions):
        scores = sums[owners == q]
        lengths = np.array([len(c.encode("utf-8")) for c in question.choices])
        correct += int(np.argmax(scores) == question.label)
        correct_norm += int(np.argmax(scores / lengths) == question.label)
    n = len(questions)
    acc, acc_norm = correct / n, correct_norm / n
    return {
        "n": n,
        "acc": acc,
        "acc_stderr": _standard_error(acc, n),
        "acc_norm": acc_norm,
        "acc_norm_stderr": _standard_error(acc_norm, n),
    }


# ------------------------------------------------------------------------------------ command line


def evaluate(
    *,
    workdir: str = "",
    hf_dir: str = "",
    step: int | None = None,
    text: str = "",
    val_files: str = "",
    max_tokens: int | None = None,
    tasks: Sequence[str] = (),
    mesh: str = "",
    tokenizer_spec: str = "",
    seq_len: int = 0,
    batch_size: int = 16,
) -> dict:
    """The results (a JSON-able dict) of every evaluation asked for; see the module docstring."""
    if bool(workdir) == bool(hf_dir):
        raise cli.UsageError("give exactly one of --workdir (a training run) and --hf (a transformers checkpoint)")
    if batch_size < 1:
        raise cli.UsageError(f"--batch_size={batch_size} must be >= 1")
    if max_tokens is not None and not val_files:
        raise cli.UsageError(f"--max_tokens={max_tokens} bounds --val_files; give the shards with --val_files, or drop it")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens < 0:
        raise cli.UsageError(f"--max_tokens={max_tokens} must be >= 0 (0: all of --val_files)")
    if hf_dir and step is not None:
        raise cli.UsageError(f"--step={step} picks a checkpoint of --workdir; an --hf folder holds one set of weights")
    if seq_len and not (text or val_files):
        raise cli.UsageError(f"--seq_len={seq_len} is the window of --text and --val_files; the run's validation set keeps its data.seq_len")
    config = None
    if workdir:
        scorer, config = from_run(workdir, step, mesh, tokenizer_spec)
    else:
        scorer = from_hf(hf_dir, mesh, tokenizer_spec)
    seq_len = seq_len or (config.data.seq_len if config is not None else min(1024, scorer.model_def.config.max_seq_len))
    if not 1 <= seq_len <= scorer.model_def.config.max_seq_len:
        raise cli.UsageError(f"--seq_len={seq_len} must be in [1, the model's max_seq_len={scorer.model_def.config.max_seq_len}]")
    results: dict = {"model": workdir or hf_dir, "tokenizer": scorer.tokenizer.name}
    if config is not None and not text and not tasks and not val_files:
        results |= validation_bits_per_byte(scorer, config, batch_size)
    if text:
        path = Path(text)
        if not path.is_file():
            raise cli.UsageError(f"--text={text} {'is a folder' if path.is_dir() else 'does not exist'}; give a UTF-8 text file")
        content = _read_utf8(path, f"--text={text}")
        if not content:  # was scored as 0 bits per byte
            raise cli.UsageError(f"--text={text} is empty; give a file with text to score")
        results["text_bits_per_byte"] = text_bits_per_byte(scorer, content, seq_len=seq_len, batch_size=batch_size)
    if val_files:
        results |= shards_bits_per_byte(scorer, val_files, seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens)
    for task in tasks:
        results[Path(task).stem] = multiple_choice(scorer, read_questions(task), batch_size=batch_size)
    return results


def main(argv: list[str]) -> None:
    del argv  # cli.parse_flags refuses positional arguments
    f = flags.FLAGS
    cli.quiet_logging(f.verbose)
    cli.split_cpu_devices()
    try:
        results = evaluate(
            workdir=f.workdir or "", hf_dir=f.hf or "", step=f.step, text=f.text or "", val_files=f.val_files or "",
            max_tokens=f.max_tokens, tasks=[t for t in f.tasks if t],
            mesh=f.mesh, tokenizer_spec=f.tokenizer or "", seq_len=f.seq_len, batch_size=f.batch_size,
        )  # fmt: skip
    except (cli.UsageError, tokenizer.TokenizerError) as e:
        if f.verbose:
            raise
        cli.usage_exit(str(e))
    text = json.dumps(results, indent=2)
    if f.out:
        Path(f.out).write_text(text + "\n")
    print(text)
    print(f"# evaluated {results['model']}", file=sys.stderr)


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "A training run's workdir (its config.json and checkpoints).")
    flags.DEFINE_string("hf", None, "A transformers checkpoint folder (config.json, *.safetensors) instead of --workdir.")
    flags.DEFINE_integer("step", None, "Checkpoint step of --workdir; default: the newest.")
    flags.DEFINE_string("text", None, "A UTF-8 text file to report bits per byte on.")
    flags.DEFINE_string("val_files", None, "Held-out token shards (glob, comma-separated) to report bits per byte on.")
    flags.DEFINE_integer("max_tokens", None, f"Score at most this many tokens of --val_files (default {DEFAULT_MAX_TOKENS:,}); 0: all.")
    flags.DEFINE_list("tasks", [], "Multiple-choice JSONL files ({context, choices, label} per line).")
    flags.DEFINE_string("tokenizer", None, "Tokenizer spec (lm.data.tokenizer.load); default: the run's, or --hf's tokenizer file, else bytes.")
    flags.DEFINE_string("mesh", "", "Mesh to evaluate on (sharding.mesh.make_mesh); empty: every device data-parallel.")
    flags.DEFINE_integer("seq_len", 0, "Window of --text and --val_files scoring; 0: the run's data.seq_len (--hf: min(1024, max_seq_len)).")
    flags.DEFINE_integer("batch_size", 16, "Rows per scoring batch (rounded up to a multiple of the batch shards).")
    cli.define_output_file_flag("out", "Also write the results JSON here.")
    cli.define_cpu_devices_flag()
    cli.define_verbose_flag()


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
