"""``tunedeck train``'s flags: one spelling in ``--help``, and every older spelling still gives the same config."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Literal, get_args

import pytest

from engine.cli.flags import config_fields, config_from_args, flag_name, grouped_name
from engine.cli.train import train_parser
from engine.config import RunConfig

OLD_SPELLINGS = (
    "--model",
    "--qlora",
    "--model-dtype",
    "--model-revision",
    "--trust-remote-code",
    "--allow-pickle-weights",
    "--data",
    "--data-format",
    "--data-train-on-all-tokens",
    "--data-max-seq-len",
    "--data-overlong",
    "--data-tokens-per-batch",
    "--data-eval-fraction",
    "--data-eval-path",
    "--lora-rank",
    "--lora-alpha",
    "--lora-dropout",
    "--lora-target-modules",
    "--max-steps",
    "--epochs",
    "--lr",
    "--training-weight-decay",
    "--training-warmup-steps",
    "--training-schedule",
    "--grad-accum",
    "--training-max-grad-norm",
    "--training-eval-every",
    "--training-save-every",
    "--seed",
    "--device",
    "--training-max-bad-steps",
    "--gpus",
    "--parallel",
    "--metadata-cache",
    "--checkpointing",
    "--moe-routing",
    "--attention-backend",
    "--fused-loss",
    "--chunked-mlp",
    "--host-embedding",
    "--lora-16bit",
    "--fused-kernels",
    "--output",
    "--name",
    "--output-keep-checkpoints",
)
"""Every settings flag ``tunedeck train`` took before the flags had one naming scheme."""

TEXT_VALUES = {
    "model.name": "./my-model",
    "model.revision": "main",
    "model.adapter": "runs/earlier-run",
    "data.path": "chats.jsonl",
    "data.eval_path": "held-out.jsonl",
    "lora.target_modules": "q_proj",
    "training.device": "cpu",
    "training.gpus": "2",
    "output.dir": "elsewhere",
    "output.name": "my-run",
    "data.eval_fraction": "0.2",
    "training.warmup_steps": "3",
    "training.eval_every": "5",
    "training.early_stop": "2",
    "training.epsilon_high": "0.28",
    "training.knowledge_share": "1.5",
    "training.knowledge_penalty": "2",
    "training.rewards": r"regex:^\d+$",
    "vision.max_pixels": "200704",
    "training.rendezvous": "10.0.0.1:29400",
    "training.node_rank": "1",
}
COMPANIONS = {
    "training.nodes": ["--rendezvous", "10.0.0.1:29400"],
    "training.node_rank": ["--nodes", "2", "--rendezvous", "10.0.0.1:29400"],
}
"""Flags a setting needs beside it to make a valid config (a second node needs the address where they meet)."""


def is_switch(annotation: Any) -> bool:
    options = get_args(annotation)
    return annotation is bool or (bool in options and type(None) in options)


def value_words(section: str, spec: dataclasses.Field[Any], annotation: Any, default: Any) -> list[str]:
    """What follows the flag to set the field to something other than its default."""
    if f"{section}.{spec.name}" in TEXT_VALUES:
        return [TEXT_VALUES[f"{section}.{spec.name}"]]
    if getattr(annotation, "__origin__", None) is Literal:
        return [next(choice for choice in get_args(annotation) if choice != default)]
    if annotation is int:
        return [str(default + 1 if default else 64)]  # 0 means automatic for some, and 1 is too short a row
    if annotation is float:
        return [str(default / 2 if default else 0.1)]
    return [TEXT_VALUES[f"{section}.{spec.name}"]]


def parsed(argv: list[str]) -> RunConfig:
    return config_from_args(train_parser().parse_args(argv), RunConfig())


def setting_words(section: str, spec: dataclasses.Field[Any], annotation: Any, default: Any, flag: str) -> list[str]:
    companions = COMPANIONS.get(f"{section}.{spec.name}", [])
    if is_switch(annotation):  # the value the default is not
        return [flag if not default else "--no-" + flag.removeprefix("--"), *companions]
    return [flag, *value_words(section, spec, annotation, default), *companions]


@pytest.mark.parametrize("field", list(config_fields()), ids=lambda f: f"{f[0]}.{f[1].name}")
def test_shown_and_grouped_spellings_give_the_same_config(field: tuple[str, Any, Any, Any]) -> None:
    section, spec, annotation, default = field
    shown = parsed(setting_words(section, spec, annotation, default, flag_name(spec)))
    grouped = parsed(setting_words(section, spec, annotation, default, grouped_name(section, spec)))
    assert shown == grouped
    assert getattr(getattr(shown, section), spec.name) != default  # the flag did set the field


def dest_of(flag: str) -> str:
    parser = train_parser()
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action.dest


@pytest.mark.parametrize("old", OLD_SPELLINGS)
def test_every_old_spelling_still_sets_its_setting(old: str) -> None:
    by_dest = {f"cfg__{s}__{spec.name}": (s, spec, a, d) for s, spec, a, d in config_fields()}
    section, spec, annotation, default = by_dest[dest_of(old)]
    assert parsed(setting_words(section, spec, annotation, default, old)) == parsed(
        setting_words(section, spec, annotation, default, flag_name(spec))
    )


def test_help_shows_one_spelling_per_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--help"])
    listing = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    shown = {word.rstrip(",") for words in listing for word in words if word.startswith("--")}
    shown_names = {flag_name(spec) for _, spec, _, _ in config_fields()}
    hidden = {grouped_name(section, spec) for section, spec, _, _ in config_fields()} - shown_names
    assert shown_names <= shown
    assert not hidden & shown
    for prefix in ("--training-", "--model-", "--output-", "--speed-"):
        assert not [flag for flag in shown if flag.startswith(prefix)]


def test_shown_names_are_unique() -> None:
    names = [flag_name(spec) for _, spec, _, _ in config_fields()]
    assert len(names) == len(set(names))
    assert isinstance(train_parser(), argparse.ArgumentParser)  # argparse also refuses a clash when built
