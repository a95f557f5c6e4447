"""``tunedeck train``'s settings flags, generated from the config dataclasses (engine.config).

Each setting is defined once, in the config tree; precedence is defaults < ``--config FILE`` < explicit flags.

One naming scheme: a setting's flag is its field name in kebab-case (``training.weight_decay`` is
``--weight-decay``, ``data.tokens_per_batch`` is ``--tokens-per-batch``), unless the config names a clearer
spelling for it (``--model``, ``--data``, ``--lr``, ``--lora-rank``, ``--output``...). Every setting also
answers to its full grouped name, ``--SECTION-FIELD`` (``--training-weight-decay``): a hidden alias, so
scripts written against either spelling keep working and ``--help`` shows one style.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from typing import Any, get_args, get_type_hints

from engine.config import RunConfig, coerce_value, flag_name, flag_options

__all__ = ["add_config_flags", "config_fields", "config_from_args", "flag_name", "grouped_name"]


def grouped_name(section: str, spec: dataclasses.Field[Any]) -> str:
    """The setting's full name as a flag, ``--SECTION-FIELD``; accepted for every setting, never shown."""
    return f"--{section}-{spec.name}".replace("_", "-")


def _dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def config_fields() -> Iterator[tuple[str, dataclasses.Field[Any], Any, Any]]:
    """(section, field, type annotation, default) for every setting of the config tree, in order."""
    defaults = RunConfig()
    for section in dataclasses.fields(RunConfig):
        section_type = type(getattr(defaults, section.name))
        hints = get_type_hints(section_type)
        for spec in dataclasses.fields(section_type):
            yield section.name, spec, hints[spec.name], getattr(getattr(defaults, section.name), spec.name)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section, with the field's help text and default."""
    groups: dict[str, Any] = {}
    for section, spec, annotation, default in config_fields():
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} settings")
        _add_field_flag(groups[section], section, spec, annotation, default)


def _add_field_flag(group: Any, section: str, spec: dataclasses.Field[Any], annotation: Any, default: Any) -> None:
    kwargs = {
        "dest": _dest(section, spec.name),
        "default": argparse.SUPPRESS,
        **flag_options(spec, annotation, default),
    }
    group.add_argument(flag_name(spec), **kwargs)
    alias = grouped_name(section, spec)
    if alias != flag_name(spec):
        group.add_argument(alias, **{**kwargs, "help": argparse.SUPPRESS})


def config_from_args(args: argparse.Namespace, base: RunConfig) -> RunConfig:
    """Overlay the flags the user gave on ``base``, converting and checking each value."""
    raw = base.to_dict()
    hints = {s.name: get_type_hints(type(getattr(base, s.name))) for s in dataclasses.fields(RunConfig)}
    for dest, value in vars(args).items():
        if not dest.startswith("cfg__"):
            continue
        _, section, name = dest.split("__")
        raw[section][name] = coerce_value(
            f"{section}.{name}", hints[section][name], _parse_flag_value(value, hints[section][name])
        )
    return RunConfig.from_dict(raw)


def _parse_flag_value(value: Any, annotation: Any) -> Any:
    """argparse gives strings; turn them into the field's type before the config checks them."""
    if not isinstance(value, str):
        return value
    options = [opt for opt in (get_args(annotation) or (annotation,)) if opt is not type(None)]
    target = options[0] if len(options) == 1 else annotation
    try:
        if target is int:
            return int(value)
        if target is float:
            return float(value)
    except ValueError:
        return value  # the config check names the field and the bad value
    return value
