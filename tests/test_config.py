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
        ({"lora": {"rank": -1}}, "lora.rank"),
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


OLDER_SPEED = {
    "metadata_cache": None,
    "checkpointing": "auto",
    "moe_routing": "auto",
    "attention_backend": "auto",
    "cudnn_attention": None,
    "fused_loss": None,
    "chunked_mlp": None,
    "host_embedding": None,
    "lora_16bit": None,
    "lora_groups": None,
    "fused_kernels": None,
    "lean_recompute": None,
    "dequant_once": None,
    "four_bit_kernel": None,
    "keep_attention": None,
    "resident_layers": None,
    "fp8_base": None,
    "fp8_scope": "all",
    "step_graphs": None,
}
"""A run folder's ``speed`` section as versions with 19 speed settings saved it."""


@pytest.mark.parametrize(
    ("saved", "attention_backend", "fp8_base"),
    [
        ({}, "auto", "auto"),
        ({"cudnn_attention": True}, "cudnn", "auto"),
        ({"cudnn_attention": False}, "varlen", "auto"),
        ({"cudnn_attention": False, "attention_backend": "flex"}, "flex", "auto"),
        ({"cudnn_attention": None, "attention_backend": "sdpa"}, "sdpa", "auto"),
        ({"fp8_base": False}, "auto", "off"),
        ({"fp8_base": True}, "auto", "all"),
        ({"fp8_base": True, "fp8_scope": "recompute"}, "auto", "recompute"),
        ({"fp8_base": None, "fp8_scope": "recompute"}, "auto", "auto"),
        (
            {"lora_groups": False, "lean_recompute": False, "four_bit_kernel": True, "keep_attention": True},
            "auto",
            "auto",
        ),
    ],
)
def test_an_older_run_folder_s_speed_settings_load(
    tmp_path: Path, saved: dict, attention_backend: str, fp8_base: str
) -> None:
    """Removed settings are dropped without an error; the merged ones map onto the settings that took them over."""
    raw = RunConfig().to_dict()
    raw["speed"] = {**OLDER_SPEED, **saved}
    (tmp_path / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    loaded = RunConfig.load(tmp_path / "config.json")
    assert (loaded.speed.attention_backend, loaded.speed.fp8_base) == (attention_backend, fp8_base)
    assert set(loaded.to_dict()["speed"]) == {"metadata_cache", "checkpointing", "moe_routing", "attention_backend",
                                              "fused_loss", "chunked_mlp", "host_embedding", "lora_16bit",
                                              "fused_kernels", "dequant_once", "resident_layers", "fp8_base",
                                              "step_graphs"}  # fmt: skip


def test_an_older_run_folder_resumes_with_its_own_settings(tmp_path: Path) -> None:
    """``tunedeck train --resume`` reads the folder's config.json; the app's run list and chat load it the same way
    (RunConfig.load)."""
    raw = RunConfig().to_dict()
    raw["speed"] = {**OLDER_SPEED, "lora_16bit": False, "fp8_base": True, "fp8_scope": "recompute"}
    raw["data"]["path"] = "chats.jsonl"
    (tmp_path / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    from engine.cli.train import train_config

    config = train_config(train_parser().parse_args(["--resume", str(tmp_path)]))
    assert config.speed.lora_16bit is False and config.speed.fp8_base == "recompute"
    assert config.data.path == "chats.jsonl"


def test_a_speed_key_no_version_had_is_still_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        RunConfig.from_dict({"speed": {"lora_grups": True}})
