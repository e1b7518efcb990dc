"""Config blocks generated from the dataclasses they configure, so every field is a ``--config`` key."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict


def dataclass_block(
    cls: type, *, only: Iterable[str] | None = None, placeholders: Iterable[str] = (), extra: Mapping[str, Any] | None = None
) -> ml_collections.ConfigDict:
    """A config block with one key per field of the dataclass ``cls`` (those in ``only``), plus ``extra``.

    A key takes its field's default, or is a placeholder of the field's type (None until set) when
    it is in ``placeholders``: a value another source fills, e.g. a model preset.
    """
    hints = typing.get_type_hints(cls)
    names = None if only is None else set(only)
    placeholders = set(placeholders)
    block = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        if f.name in placeholders:
            block[f.name] = config_dict.placeholder(hints[f.name])
        elif f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default; make it a placeholder")
        else:
            block[f.name] = f.default
    for key, value in (extra or {}).items():
        block[key] = value
    return block
