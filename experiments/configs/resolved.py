"""A run's written ``config.json`` as a config, to repeat the run or to start from it.

    python -m experiments.train --config=runs/x/config.json --workdir=runs/x-again
    python -m experiments.train --config=experiments/configs/resolved.py:runs/x/config.json   # the same

The JSON's values are laid over `default.get_config` for its optimizer, so every key keeps its type
and ``--config.<key>=...`` overrides work as with any config file.
"""

import json
from pathlib import Path

import ml_collections

from experiments.configs import default


RUN_BLOCKS = frozenset({"model", "data", "optimizer"})  # what every run's config.json holds


def is_run_config(values: object) -> bool:
    """Whether ``values`` (a parsed JSON) is a run's written config: a transformers config.json, or one of
    another program, is not."""
    return isinstance(values, dict) and RUN_BLOCKS <= values.keys()


def _merge(base: ml_collections.ConfigDict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(base.get(key), ml_collections.ConfigDict):
            _merge(base[key], value)
        elif key in base and base[key] is not None and value is not None and not isinstance(base[key], type(value)):
            base[key] = type(base[key])(value)  # e.g. 1 (JSON) into a float key
        else:
            base[key] = value


def get_config(path: str) -> ml_collections.ConfigDict:
    """The config in the JSON file ``path`` (a run's ``config.json``)."""
    if not path:
        raise ValueError("--config=experiments/configs/resolved.py:PATH needs the path of a run's config.json")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--config={path}: no such file; give a run's config.json")
    try:
        values = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--config={path} is not a JSON config ({e})") from e
    if isinstance(values, dict) and "architectures" in values:
        raise ValueError(
            f"--config={path} is a transformers checkpoint's config.json, not a run's: start from its weights with "
            f"--config.init_from_hf={file.parent}"
        )
    if not is_run_config(values):
        raise ValueError(f"--config={path} is not a run's config.json (no model, data and optimizer blocks)")
    name = values["optimizer"].get("name", "adamw")
    config = default.get_config(name)
    _merge(config, values)
    return config
