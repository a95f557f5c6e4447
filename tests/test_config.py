from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli.flags import config_from_args
from engine.cli.train import train_parser
from engine.config import RunConfig
from engine.errors import ConfigError


def test_config_round_trips_through_json(tmp_path: Path) -> None:
    config = RunConfig()
    config.lora.rank = 8
    config.speed.metadata_cache = False
    config.save(tmp_path / "config.json")
    assert RunConfig.load(tmp_path / "config.json") == config


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"rnak": 4}}, "unknown key"),
        ({"trainig": {}}, "unknown config section"),
        ({"training": {"learning_rate": "fast"}}, "training.learning_rate: must be a number"),
        ({"training": {"max_steps": 2.5}}, "training.max_steps: must be an integer"),
        ({"data": {"overlong": "wrap"}}, "data.overlong: must be one of"),
        ({"data": {"max_seq_len": 4096, "tokens_per_batch": 1024}}, "data.tokens_per_batch"),
        ({"model": {"qlora": "yes"}}, "model.qlora: must be true or false"),
        ({"training": {"device": "tpu"}}, "training.device"),
    ],
)
def test_bad_config_values_name_the_field(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict(raw)


def test_bad_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        RunConfig.load(bad)
    with pytest.raises(ConfigError, match="not found"):
        RunConfig.load(tmp_path / "missing.json")


def test_flags_override_config_file_which_overrides_defaults(tmp_path: Path) -> None:
    base = RunConfig.from_dict({"training": {"max_steps": 7, "learning_rate": 1e-3}, "lora": {"rank": 4}})
    args = train_parser().parse_args(
        ["--max-steps", "9", "--no-metadata-cache", "--lora-target-modules", "q_proj,v_proj", "--qlora"]
    )
    config = config_from_args(args, base)
    assert config.training.max_steps == 9
    assert config.training.learning_rate == 1e-3
    assert config.lora.rank == 4
    assert config.speed.metadata_cache is False
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.model.qlora is True


def test_flag_with_bad_value_names_the_setting() -> None:
    args = train_parser().parse_args(["--lora-rank", "many"])
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        config_from_args(args, RunConfig())


def test_every_config_field_has_help_text() -> None:
    import dataclasses

    for section in dataclasses.fields(RunConfig):
        for spec in dataclasses.fields(type(getattr(RunConfig(), section.name))):
            assert spec.metadata.get("help"), f"{section.name}.{spec.name} has no help"
    assert json.dumps(RunConfig().to_dict())


def test_deeply_nested_or_unreadable_config_file(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        RunConfig.load(deep)
    with pytest.raises(ConfigError, match="cannot read"):
        RunConfig.load(tmp_path)  # a folder, not a file
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"lora": {"rank": -1}}))
    with pytest.raises(ConfigError, match=r"wrong\.json: lora\.rank"):
        RunConfig.load(wrong)
