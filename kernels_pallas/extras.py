"""Optional kernel libraries: whether one imports, and the error that names its install command.

`tokamax <https://github.com/openxla/tokamax>`_ (``pip install spmdlab[tokamax]``) serves as one more
implementation of the attention op (`kernels_pallas.attention.tokamax_op`) and of the grouped matmul
(`kernels_pallas.gmm.tokamax_op`). Nothing imports it unless one of those is chosen.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from absl import flags

TOKAMAX_INSTALL = "pip install spmdlab[tokamax]"


@functools.cache
def tokamax_missing() -> str | None:
    """Why ``import tokamax`` fails here (naming the install command), or None where it imports."""
    try:
        importlib.import_module("tokamax")
    except ImportError as e:
        return f"tokamax is not installed ({TOKAMAX_INSTALL}): {e}"
    return None


def tokamax(what: str) -> ModuleType:
    """The ``tokamax`` module, or a ValueError saying that ``what`` needs it and how to install it.

    tokamax's options are absl flags that it reads at trace time, parsing ``sys.argv`` first where
    nothing has parsed the flags (its ``_src/config.py``): under pytest or in a notebook that raises
    ``UnrecognizedFlagError`` on their arguments. Outside an absl app (`absl.app.run` parses the flags),
    the flags are marked parsed here, so tokamax's options keep their defaults.
    """
    reason = tokamax_missing()
    if reason is not None:
        raise ValueError(f"{what} needs tokamax: {reason}; or choose another implementation")
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return importlib.import_module("tokamax")
