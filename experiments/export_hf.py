r"""Exports a training run's checkpoint as a Hugging Face transformers checkpoint (safetensors).

    python -m experiments.export_hf --workdir=runs/tiny --out=exports/tiny
    python -m experiments.export_hf --workdir=runs/moe --out=exports/moe --max_shard_mb=2000 --step=400 --dtype=bfloat16

Restores the newest checkpoint of ``--workdir`` (or ``--step``) and writes ``config.json`` and
``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files of at most ``--max_shard_mb`` and
their ``model.safetensors.index.json``) in the layout `lm.hf` describes: Llama, Qwen3 (QK-norm),
Qwen3-MoE, Mixtral (routed MoE) or DeepSeek-V2 (MLA). A run trained on shards of a subword tokenizer (their ``manifest.json`` names
it) also gets its tokenizer file (``tokenizer.json``, or ``tokenizer.model`` for SentencePiece) and
the BOS / EOS ids in ``config.json``. The byte-level tokenizer has no transformers equivalent: such
an export holds the weights only (token ``i`` is byte ``i``; see `lm.data.tokenizer`).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from absl import app, flags, logging

from experiments import cli
from experiments.restore import TOKENIZER_NAMES, load_params, run_manifest
from lm import hf
from lm.data import tokenizer


def copy_tokenizer(manifest: dict | None, out: Path) -> Path | None:
    """Copies the subword tokenizer that ``manifest`` names into ``out``; returns the copy (None: none to copy)."""
    spec = (manifest or {}).get("tokenizer", "bytes")
    if spec in ("", "bytes"):
        return None
    source = Path(spec).expanduser()
    source = source / "tokenizer.json" if source.is_dir() else source
    if not source.is_file():
        logging.warning("the run's tokenizer %s is gone; the export holds no tokenizer (copy it in by hand)", source)
        return None
    if tokenizer.file_fingerprint(source) != manifest.get("tokenizer_sha256"):
        logging.warning("%s changed since the shards were tokenized; the export holds no tokenizer", source)
        return None
    target = out / TOKENIZER_NAMES.get(source.suffix, source.name)
    shutil.copyfile(source, target)
    return target


def check_out(out: Path) -> None:
    """Raises `cli.UsageError` when ``out`` holds something an export would write over that is not an earlier
    export: a training run (its ``config.json`` is the run's, which the export's would replace), or a
    ``config.json`` that is not a transformers checkpoint's."""
    if (out / "checkpoints").is_dir() or (out / "metrics.jsonl").is_file():
        raise cli.UsageError(f"--out={out} holds a training run, whose config.json the export would replace; give another folder (e.g. {out / 'hf'})")
    config = out / hf.CONFIG
    if config.is_file():
        try:
            is_transformers = "architectures" in json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
            is_transformers = False
        if not is_transformers:
            raise cli.UsageError(f"--out={out} holds a config.json that is not a transformers checkpoint's; give another folder")


def export(
    workdir: str | Path, out: str | Path, *, step: int | None = None, max_shard_bytes: int = 5 * 2**30, dtype: str = "float32"
) -> list[Path]:
    """Writes checkpoint ``step`` (default: the newest) of the run in ``workdir`` into ``out``; returns the files.

    Raises:
      cli.UsageError: no such run or checkpoint, a model without a transformers equivalent (named), or an ``out``
        that holds something other than an earlier export (`check_out`).
    """
    workdir, out = Path(workdir), Path(out)
    check_out(out)
    model_def, params, saved_step = load_params(workdir, step)
    try:
        architecture = hf.architecture(model_def.config)
        files = hf.save(out, model_def.config, params, max_shard_bytes=max_shard_bytes, dtype=dtype)
    except hf.CheckpointError as e:
        raise cli.UsageError(str(e)) from e
    except OSError as e:
        raise cli.UsageError(f"cannot write the export into {out} ({e}); give --out a writable folder with room") from e
    if model_def.config.n_experts and model_def.config.capacity_factor > 0:
        logging.warning(
            "model.capacity_factor=%g drops the tokens past an expert's capacity in the run's forward pass; %s routes "
            "every token (dropless), as the run's own sampler does, so the export's logits equal the run's wherever no "
            "token overflowed (compare evaluate --workdir and --hf on the same text)", model_def.config.capacity_factor, architecture,
        )
    manifest = run_manifest(workdir)
    if manifest is not None:
        config_path = out / hf.CONFIG
        ids = {f"{k}_token_id": manifest.get(f"{k}_id") for k in ("bos", "eos")}
        config_path.write_text(json.dumps(json.loads(config_path.read_text()) | ids, indent=2) + "\n")
    for stale in tokenizer.FILE_NAMES:  # an earlier export's: evaluate --hf would read it for this model's ids
        (out / stale).unlink(missing_ok=True)
    tokenizer_file = copy_tokenizer(manifest, out)
    logging.info("exported step %d of %s", saved_step, workdir)
    return files + ([tokenizer_file] if tokenizer_file else [])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        cli.usage_exit(f"unexpected arguments {argv[1:]}")
    f = flags.FLAGS
    cli.quiet_logging(f.verbose)
    if f.max_shard_mb <= 0:
        cli.usage_exit(f"--max_shard_mb={f.max_shard_mb} must be > 0")
    try:
        files = export(f.workdir, f.out, step=f.step, max_shard_bytes=int(f.max_shard_mb * 2**20), dtype=f.dtype)
    except cli.UsageError as e:
        if f.verbose:
            raise
        cli.usage_exit(str(e))
    print(f"# {f.workdir} -> {f.out}", file=sys.stderr)
    for path in files:
        print(path)


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "A training run's workdir (its config.json and checkpoints).", required=True)
    cli.define_output_folder_flag("out", None, "Folder to write the transformers checkpoint into.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step to export; default: the newest.")
    flags.DEFINE_enum("dtype", "float32", list(hf.EXPORT_DTYPES), "Weight dtype of the export (float32 is exact).")
    flags.DEFINE_float("max_shard_mb", 5 * 1024, "Largest safetensors file in MiB; more tensors go into numbered files with an index.")
    cli.define_verbose_flag()


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
