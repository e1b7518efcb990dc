r"""Samples text from a training run's checkpoint, decoding with a KV cache.

    python -m experiments.sample --workdir=runs/tiny --prompt="def " --max_new_tokens=200 \
        --temperature=0.8 --top_p=0.95 --num_samples=2

Reads the run's ``config.json``, rebuilds its model and optimizer (a checkpoint holds both), restores
the newest checkpoint (or ``--step``) onto one device and prints each sample. Sampling is
`lm.sampling`: temperature (0: greedy), then top-k, then top-p. A sample starts a new document (the
prompt follows the document separator, as every document does in training) and ends at the next one.
Text is encoded and decoded with the run's tokenizer: byte-level for the text corpus, else the copy the
run keeps in its workdir (runs from before that copy: the one the shards' manifest names; ``--tokenizer``
names it where that path is gone). Only the workdir is read, so this works from any folder.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import cli, restore
from lm import model as model_lib
from lm import sampling
from lm.data import tokenizer


def sample(
    model_def: model_lib.ModelDef,
    params: model_lib.Params,
    prompt: str,
    *,
    num_samples: int = 1,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 0.95,
    seed: int = 0,
    tok: tokenizer.Tokenizer | None = None,
) -> list[str]:
    """``num_samples`` continuations of ``prompt`` as text, each cut at the first document separator.

    ``tok`` encodes the prompt and decodes the samples (default: byte-level); only its ids are sampled.
    """
    if num_samples < 1:
        raise cli.UsageError(f"--num_samples={num_samples} must be >= 1")
    tok = tok or tokenizer.load("bytes")
    separator = tok.separator_id
    prefix = np.concatenate([[] if separator is None else [separator], tok.encode(prompt)]).astype(np.int32)
    try:
        generate = sampling.make_generate(
            model_def,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            valid_vocab=tok.vocab_size,
        )
        tokens = generate(params, jnp.asarray(np.tile(prefix, (num_samples, 1))), jax.random.key(seed))
    except ValueError as e:
        raise cli.UsageError(str(e)) from e
    texts = []
    for row in np.asarray(tokens)[:, len(prefix) :]:
        end = np.flatnonzero(row == separator) if separator is not None else np.array([], int)
        texts.append(prompt + tok.decode(row[: end[0]] if end.size else row))
    return texts


def main(argv: list[str]) -> None:
    del argv  # cli.parse_flags refuses positional arguments
    f = flags.FLAGS
    cli.quiet_logging(f.verbose)
    try:
        model_def, params, step = restore.load_params(f.workdir, f.step)
        tok = restore.load_tokenizer(f.workdir, f.tokenizer)
        texts = sample(
            model_def,
            params,
            f.prompt,
            num_samples=f.num_samples,
            max_new_tokens=f.max_new_tokens,
            temperature=f.temperature,
            top_k=f.top_k,
            top_p=f.top_p,
            seed=f.seed,
            tok=tok,
        )
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    print(f"# {f.workdir}, checkpoint step {step}", file=sys.stderr)
    for i, text in enumerate(texts):
        print(f"----- sample {i} -----\n{text}")


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "A training run's workdir (its config.json and checkpoints).", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step to sample from; default: the newest.")
    flags.DEFINE_string("prompt", "def ", "Text the samples continue.")
    flags.DEFINE_integer("num_samples", 1, "Number of samples (one batch).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens generated per sample (bytes for a byte-level run).")
    flags.DEFINE_string("tokenizer", None, "Tokenizer file to encode / decode with; default: the run's (bytes, or its shards' manifest's).")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy decoding.")
    flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 keeps all.")
    flags.DEFINE_float("top_p", 0.95, "Keep the smallest set of most likely tokens with this much probability; 1 keeps all.")
    flags.DEFINE_integer("seed", 0, "Random seed of the sampler.")
    cli.define_verbose_flag()


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
