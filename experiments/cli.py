"""What every entry point's command line shares: one-line usage errors (exit code 2), absl flag
parsing, the ``--config`` flag with ``--config.<key>`` overrides, quiet library logging, and the
multi-process start-up flags (`sharding.multihost`)."""

from __future__ import annotations

import importlib.util
import logging as std_logging
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from absl import flags, logging
from ml_collections import config_flags

from sharding import cpu_devices, multihost

DEFAULT_CONFIG = str(Path(__file__).parent / "configs" / "default.py")
# Reads a run's config.json (``--config=runs/x/config.json`` is short for ``--config=<this>:runs/x/config.json``).
JSON_CONFIG = str(Path(__file__).parent / "configs" / "resolved.py")

# Loggers that report routine work at INFO (backend probing, checkpoint bookkeeping).
_LIBRARY_LOGGERS = ("jax", "absl", "orbax", "etils")


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2."""


def usage_exit(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_counts(*names: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Raises `UsageError` naming the first of the integer flags ``names`` below 1."""
    for name in names:
        value = flag_values[name].value
        if value < 1:
            raise UsageError(f"--{name}={value} must be >= 1")


def require_counts(*names: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """`check_counts` at the start of a script's ``main``: a count below 1 exits with its usage error."""
    try:
        check_counts(*names, flag_values=flag_values)
    except UsageError as e:
        usage_exit(str(e))


def parse_flags(argv: list[str], *, arguments: int = 0) -> list[str]:
    """absl flag parsing with one-line errors and exit code 2 for bad flags or more than ``arguments`` positional
    arguments (`parse_flags_and_one_argument`); ``--config=X.json`` reads a run's written config (`JSON_CONFIG`)."""
    argv = [_json_config(arg) for arg in argv]
    try:
        rest = flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 (a --config file raised as it loaded: not Python, or a bug in it)
        if (message := _override_error(e, argv)) is not None:
            usage_exit(message)
        if isinstance(e, (flags.Error, KeyError, TypeError, ValueError)):
            usage_exit(_one_line(str(e)))
        usage_exit(_config_load_error(e))
    if len(rest) > 1 + arguments:
        usage_exit(f"unexpected arguments {rest[1 + arguments:]}; every option is a --flag=value (--helpfull lists them)")
    if "config" in flags.FLAGS and flags.FLAGS["config"].present:
        try:  # ml_collections defers a config file's IOError (a folder, a missing file) to the config's first use
            flags.FLAGS.config.keys()
        except OSError as e:
            usage_exit(_config_load_error(e))
    return rest


def _override_error(error: Exception, argv: list[str]) -> str | None:
    """The line for a ``--config.<key>`` override that the ``--config`` file given in ``argv`` has no place for, as
    `define_config_flag` words it for the default file (None: ``error`` is not about an override). ml_collections
    applies a given file's overrides while absl parses, and its errors read as the file's own."""
    given = [arg.split("=", 1)[1] for arg in argv if arg.split("=", 1)[0] in ("--config", "-config") and "=" in arg]
    if not given or not _override_names(argv):
        return None
    if (message := setting_as_block_message(given[-1], argv)) is not None:
        return message
    if isinstance(error, (KeyError, AttributeError)) and error.args:
        key, _ = _key_and_hint(str(error.args[0]))
        if any(key in name.split(".") for name in _override_names(argv)):
            return unknown_key_message(str(error.args[0]), given[-1], argv, flag_names=list(flags.FLAGS))
    return None


def parse_flags_and_one_argument(argv: list[str]) -> list[str]:
    """`parse_flags` for a script that takes one positional argument (a folder to read)."""
    return parse_flags(argv, arguments=1)


def _config_load_error(e: Exception) -> str:
    """One line for a ``--config`` file that failed to load: the cause, and where in the file when it raised."""
    cause = e.__cause__ or e
    frames = traceback.extract_tb(cause.__traceback__)
    in_file = frames and not isinstance(cause, (OSError, SyntaxError)) and not frames[-1].filename.startswith("<")
    where = f", at {frames[-1].filename} line {frames[-1].lineno}" if in_file else ""  # a SyntaxError names its line
    return (
        f"the --config file failed to load ({type(cause).__name__}: {' '.join(str(cause).split())}{where}); give a Python "
        "file with get_config() (experiments/configs/) or a run's config.json"
    )


def _one_line(message: str) -> str:
    """A flag error without the traceback that ml_collections puts in when a config file's ``get_config`` raises."""
    if "Traceback (most recent call last)" not in message:
        return message
    flag = message.partition(": Error whilst parsing config file")[0]
    return f"{flag}: {message.strip().splitlines()[-1].partition(': ')[2]}"


def _json_config(arg: str) -> str:
    name, sep, value = arg.partition("=")
    if sep and name in ("--config", "-config") and value.endswith(".json"):
        return f"{name}={JSON_CONFIG}:{value}"
    return arg


def define_config_flag(default: str) -> flags.FlagHolder:
    """``--config`` with ``--config.<key>`` overrides; an unknown key exits with code 2."""
    try:
        return config_flags.DEFINE_config_file(
            "config", default, "Config file (ml_collections; FILE.py:ARG passes ARG to its get_config, a run's config.json "
            "repeats that run); --config.<key>=<value> overrides a key, --list_config lists them all.", lock_config=True,
        )  # fmt: skip
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # config_flags applies --config.* overrides right here
        if (message := setting_as_block_message(default, sys.argv[1:])) is not None:
            usage_exit(message)  # ml_collections raises any of the four for it, depending on the setting's value
        if isinstance(e, (TypeError, ValueError)):
            raise
        usage_exit(unknown_key_message(str(e.args[0] if e.args else e), default, sys.argv[1:], flag_names=list(flags.FLAGS)))


def changed_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """``"key: old -> new, ..."`` over the keys whose values differ, sorted (empty when none do): what a rerun
    into a folder written with ``old`` settings would change."""
    return ", ".join(f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k))


def unknown_key_message(error: str, default: str, argv: list[str], flag_names: Sequence[str] = ()) -> str:
    """The line for a ``--config.<key>`` override that ml_collections refused with ``error``: the key's whole
    path, ml_collections' near spelling in its block, the keys of the same name in other blocks of the
    config file ``default``, and the script's flag of that name (``--config.workdir`` for ``--workdir``)."""
    key, hint = _key_and_hint(error)
    path = next((name for name in _override_names(argv) if name.rsplit(".", 1)[-1] == key), None) or next(
        (name.rpartition(f".{key}.")[0] + f".{key}" for name in _override_names(argv) if f".{key}." in f".{name}"), key
    ).lstrip(".")  # an unknown block ("model.x" of --config.model.x.y) is named down to itself
    elsewhere = [name for name in _config_keys(default) if name.rsplit(".", 1)[-1] == key and name != path]
    hints = [hint.strip()] if hint.strip() else []
    if path in flag_names and path != "config":
        hints.append(f"--{path} is a flag of this script, not a config key")
    if elsewhere:
        moves = " or ".join(f"--config.{name}" for name in elsewhere)
        hints.append(f"or {moves}?" if hints else f"did you mean {moves}?")
    hint = f" ({' '.join(hints)})" if hints else ""
    return f"unknown config key {path!r}{hint}; the keys are listed in {_shown_config(default)}"


def _key_and_hint(error: str) -> tuple[str, str]:
    """The key and ml_collections' spelling hint in its error for an unknown ``--config.<key>``."""
    key, _, hint = error.replace("\\'", "'").replace("\\n", "\n").strip("'\"").partition("\n")
    return key.strip("'"), hint


def setting_as_block_message(default: str, argv: list[str]) -> str | None:
    """The line for a ``--config.<setting>.<key>`` override, which treats a setting of the config file ``default``
    (a value, such as ``replicas``) as a block of keys; None when no override does."""
    settings = set(_config_keys(default))
    for name in _override_names(argv):
        parts = name.split(".")
        setting = next((".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) in settings), None)
        if setting is not None:
            return f"--config.{name}: {setting!r} is a setting, not a block of keys; give --config.{setting}=VALUE"
    return None


def _override_names(argv: list[str]) -> list[str]:
    """The keys that ``--config.<key>=<value>`` arguments set (ml_collections names only the last part of a bad one)."""
    return [arg.split("=", 1)[0].lstrip("-").removeprefix("config.") for arg in argv if arg.lstrip("-").startswith("config.")]


def _shown_config(path: str) -> str:
    """A ``--config`` value as the user gave it (a run's ``config.json``, not its reader `JSON_CONFIG`)."""
    return path.removeprefix(f"{JSON_CONFIG}:")


def _config_keys(path: str) -> list[str]:
    """Every dotted key of the config file ``path``'s ``get_config()`` (``FILE.py:ARG``: ``get_config(ARG)``; none
    when it cannot be loaded)."""
    file, _, argument = path.partition(":")
    try:
        module_spec = importlib.util.spec_from_file_location("_config_keys", file)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        config = module.get_config(argument) if argument else module.get_config()
    except Exception:  # noqa: BLE001 (a file that fails to load has no keys to offer; its own error is reported)
        return []
    # Imported on this error path only: it imports every optimizer's spec, which most scripts never need.
    from experiments.configs import help as config_help

    return [name for name, _ in config_help.flatten(config)]


def define_int_list_flag(
    name: str,
    default: Sequence[int] | None,
    help_text: str,
    *,
    allow_empty: bool = False,
    minimum: int = 1,
    example: str = "",
    flag_values: flags.FlagValues = flags.FLAGS,
) -> flags.FlagHolder:
    """A comma-separated list of integers >= ``minimum`` (sequence lengths, batch sizes, device ids), as strings,
    refused in one line as the flags are parsed when an item is not one (it was a ValueError traceback, or
    "invalid literal for int()", where the script read it). ``example``: the list the message shows (the default's)."""
    holder = flags.DEFINE_list(name, None if default is None else [str(n) for n in default], help_text, flag_values=flag_values)
    kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
    example = example or ",".join(map(str, default or ()))

    def integers(values: list[str] | None) -> bool:
        if values is None:
            return True
        if not values and not allow_empty:
            raise flags.ValidationError(f"empty; give comma-separated {kind}, e.g. {example}")
        if not all(v.strip().isdigit() and int(v) >= minimum for v in values):
            raise flags.ValidationError(f"not comma-separated {kind}, e.g. {example}")
        return True

    flags.register_validator(name, integers, flag_values=flag_values)
    return holder


def define_output_file_flag(name: str, help_text: str, flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
    """A string flag naming a file the script writes when its work is done (a results JSON). Its folder is made,
    and the path checked, as the flags are parsed: a benchmark that ran for minutes used to lose its results
    to a missing folder at the end."""
    holder = flags.DEFINE_string(name, None, help_text + " Its folder is made if missing.", flag_values=flag_values)

    def writable(path: str | None) -> bool:
        if not path:
            return True
        out = Path(path).expanduser()
        if out.is_dir():
            raise flags.ValidationError(f"{path} is a folder; give a file name")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise flags.ValidationError(f"cannot make the folder {out.parent} ({e.strerror}); give a writable path") from e
        if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
            raise flags.ValidationError(f"{path} cannot be written; give a writable path")
        return True

    flags.register_validator(name, writable, flag_values=flag_values)
    return holder


def define_output_folder_flag(
    name: str, default: str | None, help_text: str, *, required: bool = False, flag_values: flags.FlagValues = flags.FLAGS
) -> flags.FlagHolder:
    """A string flag naming a folder the script writes into (made if missing; a ``gs://`` path is not checked). A
    path that is a file, or lies under one, is refused as the flags are parsed: it used to end in a traceback from
    ``makedirs`` after the script had started."""
    holder = flags.DEFINE_string(name, default, help_text, required=required, flag_values=flag_values)

    def a_folder(path: str | None) -> bool:
        if not path or "://" in path:
            return True
        local = Path(path).expanduser()
        existing = next((p for p in (local, *local.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise flags.ValidationError(f"{existing} is a file, not a folder; give a folder (it is made if missing)")
        return True

    flags.register_validator(name, a_folder, flag_values=flag_values)
    return holder


def define_verbose_flag(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
    """``--verbose``: tracebacks for bad input and the libraries' INFO logs (`quiet_logging`)."""
    return flags.DEFINE_bool("verbose", False, "Show tracebacks for bad input, and library logs.", flag_values=flag_values)


def quiet_logging(verbose: bool = False) -> None:
    """Warnings and errors only from absl, jax and orbax, unless ``verbose``; call first in ``main``."""
    if verbose:
        return
    logging.set_verbosity(logging.WARNING)
    for name in _LIBRARY_LOGGERS:
        std_logging.getLogger(name).setLevel(std_logging.WARNING)


def define_cluster_flags() -> None:
    """How a process joins a multi-process job; every one is optional (`sharding.multihost` detects the rest)."""
    flags.DEFINE_string("coordinator_address", None, "Multi-process: host:port of process 0 (else detected).")
    flags.DEFINE_alias("coordinator", "coordinator_address")
    flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes (else detected).")
    flags.DEFINE_integer("process_id", None, "Multi-process: rank of this process (else detected).")
    define_int_list_flag(
        "local_device_ids", None, "GPUs this process drives, e.g. 0,1,2,3 (else CUDA_VISIBLE_DEVICES split over the node's processes).",
        minimum=0, example="0,1,2,3",
    )  # fmt: skip
    flags.DEFINE_enum(
        "cluster", "", ["", *multihost.CLUSTERS],
        "Where the job's shape comes from: empty detects (Slurm, Open MPI, Kubernetes, GKE TPU, JobSet, SkyPilot); "
        "auto lets JAX detect (TPU VMs); none forces one process.",
    )  # fmt: skip
    flags.DEFINE_integer("initialization_timeout", None, "Seconds to wait for all processes to connect (JAX's default: 300).")
    flags.DEFINE_integer("heartbeat_timeout", None, "Seconds without a heartbeat before a process counts as lost (JAX's default: 100).")


def define_cpu_devices_flag(default: int = 0) -> None:
    """``--cpu_devices``: the CPU backend split into that many devices, so a mesh of that size runs on a laptop."""
    flags.DEFINE_integer(
        "cpu_devices", default, "Split the CPU into this many devices (CPU backend only; sharding.cpu_devices), so "
        "that e.g. --config.mesh=stage:4,data:2 runs on a laptop with --cpu_devices=8; 0: the devices as they are.",
        lower_bound=0,
    )  # fmt: skip


def split_cpu_devices() -> None:
    """Applies ``--cpu_devices``; call in ``main`` before JAX starts its backend."""
    if flags.FLAGS.cpu_devices:
        cpu_devices.use(flags.FLAGS.cpu_devices)


def fresh_workdir(name: str, process_count: int = 1) -> str:
    """``runs/<date>-<time>-<name>``, made now by this process alone (``mkdir`` fails where it exists): a second run
    started in the same second, as a sweep launched in a loop starts them, gets ``-2``, ``-3``, ... instead of
    writing into the first one's folder. A job of several processes (``process_count``) needs ``--workdir``: each
    process would pick its own."""
    if process_count > 1:
        raise UsageError(f"a job of {process_count} processes needs --workdir, the one folder they all write; give it")
    stem = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    path, copies = stem, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            copies += 1
            path = f"{stem}-{copies}"


def start_processes() -> multihost.Start:
    """Starts `jax.distributed` as the cluster flags and the environment say and logs how, once per process;
    a bad combination exits with code 2."""
    f = flags.FLAGS
    try:
        ids = [int(i) for i in f.local_device_ids] if f.local_device_ids else None
        start = multihost.resolve(f.coordinator_address, f.num_processes, f.process_id, ids, cluster=f.cluster)
        multihost.initialize(start, initialization_timeout=f.initialization_timeout, heartbeat_timeout=f.heartbeat_timeout)
    except ValueError as e:
        usage_exit(str(e))
    if start.started:
        print(start.describe(), file=sys.stderr, flush=True)
    return start
