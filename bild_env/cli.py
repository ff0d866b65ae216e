"""Command-line options generated from dataclasses: one option per field, its default and help from the class.

Used by train.py, evaluate.py, the draft distillation and the benchmarks.

``add_options(parser, "train", TrainConfig, TrainConfig())`` adds ``--total-timesteps`` etc. The help text
of a field is its ``metadata["help"]`` (``field(default=..., metadata={"help": "..."})``, as in
``bild_env.config.CommonConfig``; ``field_help``), the default shown is the value in the instance given.
Options are parsed with ``argparse.SUPPRESS`` defaults, so ``given(namespace, "train")`` holds only the options the
user typed: ``replace(defaults, **given(...))`` builds the config, and a resumed run can tell which
saved values the user asked to change.
"""

from __future__ import annotations

import argparse
import functools
import math
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from collections.abc import Callable
from typing import Any


def field_help(cls: type) -> dict[str, str]:
    """``{field name: its help}`` of dataclass ``cls``: each field's ``metadata["help"]`` (``field(default=...,
    metadata={"help": "..."})``, as transformers' ``HfArgumentParser`` reads it; a subclass's declaration wins).
    Fields declared without help are left out; a sub-config's (a field whose default is made as a dataclass,
    ``pair_options``) is followed by each of its keys' help."""
    out = {}
    for f in fields(cls):
        if f.metadata.get("help"):
            made = f.default_factory() if f.default_factory is not MISSING else None  # ActionOptions(off_switch=True)
            keys = field_help(type(made)) if is_dataclass(made) else {}
            out[f.name] = f.metadata["help"] + "".join(f"; {k}: {text}" for k, text in keys.items())
    return out


def add_options(
    parser: argparse.ArgumentParser, section: str, cls: type, defaults: Any, skip: tuple[str, ...] = (),
    title: str | None = None, bool_values: bool = False,
) -> None:
    """Add ``--field-name`` for every field of dataclass ``cls`` not in ``skip``, in an argument group.

    Booleans are ``--flag/--no-flag`` switches, or with ``bool_values`` options that take a yes/no
    value (``--flag 0``; see ``parse_bool``).
    """
    doc = (cls.__doc__ or "").strip()
    if doc.startswith(f"{cls.__name__}("):  # the signature a dataclass without a docstring is given: no help
        doc = ""
    group = parser.add_argument_group(title or section, (doc.splitlines() or [None])[0])
    hints = typing.get_type_hints(cls)
    comments = field_help(cls)
    for f in fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        default = getattr(defaults, f.name)
        help_text = comments.get(f.name, "")
        option = "--" + f.name.replace("_", "-")
        if is_dataclass(hints[f.name]):  # a sub-config: --name KEY=VALUE ..., its fields (key_values)
            group.add_argument(option, dest=f"{section}.{f.name}", default=argparse.SUPPRESS, nargs="+",
                               metavar="KEY=VALUE", action=_KeyValues, config=hints[f.name],
                               help=help_text.replace("%", "%%"))
            continue
        if default not in (None, ""):
            shown = " ".join(map(str, default)) if isinstance(default, tuple) else default
            help_text = f"{help_text} (default: {shown})".strip()
        group.add_argument(option, dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                           help=help_text.replace("%", "%%"), **_argparse_type(hints[f.name], bool_values))


class _KeyValues(argparse.Action):
    """An option ``--name KEY=VALUE ...`` of sub-config ``config`` (a dataclass): stores the dict ``key_values``
    reads (the option given again adds its keys, a tuple's items to those given before)."""

    def __init__(self, *args, config: type, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = config

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # given again: added to it
        old, new = getattr(namespace, self.dest, {}), key_values(self.config, list(values), option_string)
        setattr(namespace, self.dest, old | {k: old[k] + v if isinstance(v, tuple) and k in old else v
                                             for k, v in new.items()})


def check_bool_fields(cfg: Any, prefix: str = "") -> None:
    """ValueError naming the first field of the dataclass instance ``cfg`` typed ``bool`` (or ``bool | None``: None
    allowed) that holds no bool (numpy's ``bool_`` counts), in ``cfg`` or its sub-configs (named ``"actions: "``):
    ``gymnasium.make(..., actions={"off_switch": "False"})`` would else switch it on. The options ``add_options``
    makes give real bools (``--flag/--no-flag``, ``parse_bool``).

    Reads each field's annotation as written (no evaluation: the other annotations may name what a test replaced)."""
    import numpy as np

    for f in fields(cfg):
        if f.default_factory is not MISSING and is_dataclass(getattr(cfg, f.name)):  # a sub-config
            check_bool_fields(getattr(cfg, f.name), f"{prefix}{f.name}: ")
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        optional = kind.replace(" ", "") in ("bool|None", "None|bool", "Optional[bool]", "typing.Optional[bool]")
        if kind != "bool" and not optional:
            continue
        value = getattr(cfg, f.name)
        if not isinstance(value, (bool, np.bool_)) and not (optional and value is None):
            raise ValueError(f"{prefix}{f.name} must be True or False{' (or None)' if optional else ''}, got {value!r} "
                             f"({type(value).__name__})")


def parse_bool(text: str) -> bool:
    """Parse a yes/no option value ("1/0", "true/false", "yes/no", "on/off"); refuse anything else."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a yes/no value: give 1/0, true/false, yes/no or on/off")


def _argparse_type(hint: Any, bool_values: bool = False) -> dict[str, Any]:
    """argparse keywords for a field type: scalars, ``X | None``, ``tuple[X, ...]`` (nargs) and bools."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(kinds) > 1 and all(k in (int, float, str) for k in kinds):  # int | str: 3 as an int, "auto" as a str
            return {"type": functools.partial(_first, kinds), "metavar": "|".join(k.__name__.upper() for k in kinds)}
        hint = kinds[0]  # str | Sequence[str] | None -> str
    if hint is bool:
        return {"type": parse_bool, "metavar": "YES/NO"} if bool_values else {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return {"type": item, "nargs": "+", "metavar": item.__name__.upper()}
    if hint in (int, float, str):
        return {"type": hint, "metavar": hint.__name__.upper()}
    raise TypeError(f"no command-line form for a field of type {hint!r}")


def given(namespace: argparse.Namespace, section: str) -> dict[str, Any]:
    """The options of ``section`` the user gave (tuples for ``nargs`` fields)."""
    prefix = section + "."
    return {k[len(prefix):]: tuple(v) if isinstance(v, list) else v
            for k, v in vars(namespace).items() if k.startswith(prefix)}



def parse_dataclass(cls: type, argv: list[str] | None = None, description: str | None = None, defaults: Any = None):
    """A one-section command line: ``defaults`` (default ``cls()``) with the options the user gave
    (``--field-name value``; a sub-config's ``--name KEY=VALUE`` over its defaults' keys); the help shows ``defaults``'
    values. A field ``out`` (the file the command writes) is checked writable here, before any work
    (``bild_env.command.writable_file``)."""
    from dataclasses import replace

    from bild_env.command import UsageExit, writable_file

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = cls() if defaults is None else defaults
    add_options(parser, "options", cls, defaults)
    values = given(parser.parse_args(argv), "options")
    cfg = replace(defaults, **{k: replace(getattr(defaults, k), **v) if isinstance(v, dict) else v
                               for k, v in values.items()})
    if isinstance(getattr(cfg, "out", None), str) and "out" in (f.name for f in fields(cls)):
        try:
            writable_file(cfg.out)  # before any work: a result that cannot be written is the work lost
        except ValueError as err:
            raise UsageExit(f"error: {err}") from None
    return cfg


def key_values(cls: type, items: list[str], option: str) -> dict[str, Any]:
    """``option KEY=VALUE ...`` (RL Zoo's ``--hyperparams``, spelt with ``=``) as fields of dataclass ``cls``: each
    value read as its field's type (a tuple comma-separated, ``net_arch=64,64``, or by its ``metadata["sep"]``, a key
    given again adding to it; a bool as ``parse_bool``
    reads it; ``none`` for an optional field); a ``UsageError`` naming the item and the keys ``cls`` has. The values
    themselves are checked by ``cls``."""
    from bild_env.command import UsageError

    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    seps = {f.name: f.metadata.get("sep", ",") for f in fields(cls)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise UsageError(f"{option} {item!r}: give KEY=VALUE, KEY one of {', '.join(names)}")
        hint = hints[key]
        try:
            if typing.get_origin(hint) is tuple:  # net_arch=64,64, train_profiles=a,b; a key again adds to it; a field
                item = typing.get_args(hint)[0]  # whose items hold commas (tree rules) says its separator
                out[key] = out.get(key, ()) + tuple(item(v) for v in text.replace(" ", seps[key]).split(seps[key]) if v)
            elif hint is bool:
                out[key] = parse_bool(text)
            else:
                kinds = [t for t in (int, float, str) if t is hint or t in typing.get_args(hint)]
                out[key] = None if text.lower() == "none" and type(None) in typing.get_args(hint) else _first(kinds, text)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
            raise UsageError(f"{option} {key}={text!r}: not a value of {key} ({err})") from None
    return out


def _first(kinds: list[type], text: str):
    """``text`` as the first of ``kinds`` that reads it (``int | str``: 3 as an int, "auto" as a str)."""
    for kind in kinds[:-1]:
        try:
            return kind(text)
        except ValueError:
            pass
    return kinds[-1](text)


def shown_fields(obj: Any, skip: tuple[str, ...] = ()) -> str:
    """``key=value, ...`` of dataclass instance ``obj`` (but the fields in ``skip``), as ``key_values`` reads them."""
    def shown(f):
        v = getattr(obj, f.name)
        return f.metadata.get("sep", ",").join(map(str, v)) if isinstance(v, tuple) else v

    return ", ".join(f"{f.name}={shown(f)}" for f in fields(obj) if f.name not in skip)


def setup_logging(level: int = 20) -> None:
    """Show the library's progress messages (``bild_env.*`` loggers: calibration, fetching a model) on
    stderr as ``[bild_env.module] message``; for command-line entry points (a library never does this)."""
    import logging

    logging.basicConfig(level=level, format="[%(name)s] %(message)s")


def parse_checked(cls: type, argv: list[str] | None, description: str, check: Callable[[Any], None],
                  defaults: Any = None) -> Any:
    """``cls``'s options parsed from ``argv`` (over ``defaults``, an instance of ``cls``; default ``cls()``) and
    logging set up; ``check`` refuses bad ones (a ValueError exits with ``error: <message>``, no traceback:
    ``bild_env.command.UsageExit``) before anything loads."""
    from bild_env.command import UsageExit

    cfg = parse_dataclass(cls, argv, description, defaults)
    setup_logging()
    try:
        check(cfg)
    except ValueError as err:
        raise UsageExit(f"error: {err}") from None
    return cfg


def report_main(cls: type, argv: list[str] | None, description: str, check: Callable[[Any], None],
                run: Callable[[Any], dict], report: Callable[[dict], str]) -> dict:
    """A benchmark's command line: parse ``cls``'s options, ``check`` them (a ValueError exits with
    ``error: <message>``, no traceback), ``run``, print ``report(result)`` and write the result as JSON to
    the config's ``out`` when it names a file."""
    import json
    from pathlib import Path

    cfg = parse_checked(cls, argv, description, check)
    result = run(cfg)
    print(report(result))
    if getattr(cfg, "out", ""):
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(finite_json(result), indent=1, allow_nan=False) + "\n")
    return result


def finite_json(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with every float that is NaN or infinite replaced by None, so that
    ``json.dumps(..., allow_nan=False)`` writes standard JSON (Python's default writes ``NaN`` and ``-Infinity``,
    which other readers refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def add_ray_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--ray [ADDRESS]`` (the ``cluster`` extra's commands): where ``what`` runs on Ray. Alone: a new local Ray
    instance on this machine's cores; with an address, that cluster. Its value is None without the option."""
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help=f"{what} on Ray: alone, a new local Ray instance on this machine's cores; with an address, "
                             "that cluster ('auto': the one `ray start` runs here; 'ray://host:10001': Ray Client)")

