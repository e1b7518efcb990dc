"""Config blocks generated from the dataclasses they configure, so every field is a ``--config`` key."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict


def dataclass_block(
    cls: type, defaults: Mapping[str, Any] | None = None, *, placeholders: Iterable[str] = ()
) -> ml_collections.ConfigDict:
    """A config block for the dataclass ``cls``: one key per field, or per entry of ``defaults``.

    A key takes its value in ``defaults`` (else its field's default), or is a placeholder of the
    field's type (None until set) when it is in ``placeholders``: a value another source fills,
    e.g. a model preset. A field of type ``X | None`` defaulting to None is a placeholder of ``X``.
    """
    hints = typing.get_type_hints(cls)
    if defaults is None:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    placeholders = set(placeholders)
    block = ml_collections.ConfigDict()
    for key, value in defaults.items():
        if key in placeholders:
            block[key] = config_dict.placeholder(hints[key])
        elif value is None:
            block[key] = config_dict.placeholder(_not_none(cls, key, hints[key]))
        elif value is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{key} has no default; make it a placeholder")
        else:
            block[key] = value
    return block


def _not_none(cls: type, key: str, hint: Any) -> type:
    """``X`` of an ``X | None`` annotation (the type a None-default key takes when set)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) != 1 or not isinstance(args[0], type):
        raise TypeError(f"{cls.__name__}.{key} defaults to None; annotate it as one type or None (X | None)")
    return args[0]
