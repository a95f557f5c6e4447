"""Speed stand-ins keep every parameter's name but not its module's type. What peft finds by type (the adapter's
weights when a run saves or resumes, its switch that turns the adapter off for DPO's reference pass) must still
see every LoRA layer while the stand-ins are in place, or an adapter is saved without its attention weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hang import HANG_S
from safetensors import safe_open
from speed_models import packed_batch, tiny_lora_model

from engine.config import SpeedConfig
from engine.speed import SpeedController
from engine.speed.chunked_mlp import TokenChunked
from engine.speed.lora_16bit import adapted_layers
from engine.speed.lora_groups import find_groups
from engine.speed.stand_in import StandIn, adapters_off, hides_an_adapter, own_tree

BATCH = packed_batch((23, 9, 17))
CHUNKED = SpeedConfig(
    metadata_cache=False, checkpointing="none", moe_routing="stock", fused_loss=False, chunked_mlp=True
)


def chunked(model: torch.nn.Module) -> SpeedController:
    """Every per-token module of ``model`` (norms, q/k/v/o, the MLP) behind a chunking stand-in."""
    ctl = SpeedController(model, CHUNKED, "cpu")
    ctl.chunked.install(8)
    assert any(isinstance(m, TokenChunked) for m in model.modules())
    return ctl


def logits(model: torch.nn.Module, ctl: SpeedController) -> torch.Tensor:
    with torch.no_grad():
        return model(**ctl.model_inputs(BATCH)).logits


def test_the_adapter_state_holds_every_lora_layer_while_stand_ins_are_in_place() -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    model = tiny_lora_model("llama")
    whole = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    assert any("self_attn.q_proj" in key for key in whole)
    stand_ins = [m for m in model.modules() if isinstance(m, StandIn)]
    chunked(model)
    with own_tree(model):
        assert not any(hides_an_adapter(m) for m in model.modules())
        assert all(isinstance(layer.mlp, TokenChunked) for layer in model.base_model.model.model.layers)  # no adapter
        saved = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
        set_peft_model_state_dict(model, {k: torch.zeros_like(v) for k, v in saved.items()})
    assert saved.keys() == whole.keys()
    assert all(torch.equal(saved[k], whole[k]) for k in whole)
    assert len([m for m in model.modules() if isinstance(m, StandIn)]) > len(stand_ins)  # back after the body
    with own_tree(model):
        loaded = get_peft_model_state_dict(model)
    assert loaded.keys() == whole.keys() and all(not v.any() for v in loaded.values())  # loaded into every layer


def test_the_16bit_lora_path_and_its_groups_find_every_layer_behind_a_stand_in() -> None:
    model = tiny_lora_model("llama")
    layers = [id(layer) for layer, _ in adapted_layers(model)]
    groups = [[id(member) for member in group.members] for group in find_groups(model, adapted_layers(model))]
    assert len(layers) == 2 * 7 and len(groups) == 2 * 2  # per layer: q/k/v and gate/up
    chunked(model)
    assert [id(layer) for layer, _ in adapted_layers(model)] == layers
    assert [[id(member) for member in group.members] for group in find_groups(model, adapted_layers(model))] == groups


def test_adapters_off_switches_every_lora_layer_off_and_keeps_the_stand_ins() -> None:
    model = tiny_lora_model("llama")  # nonzero B: the adapter changes every projection's output
    ctl = chunked(model)
    adapted = logits(model, ctl)
    with own_tree(model), model.disable_adapter():
        base = logits(model, ctl)
    assert not torch.allclose(base, adapted, atol=1e-4)
    with adapters_off(model):
        assert any(isinstance(m, TokenChunked) for m in model.modules())
        off = logits(model, ctl)
    torch.testing.assert_close(off, base)
    torch.testing.assert_close(logits(model, ctl), adapted)


def lora_keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as weights:
        return set(weights.keys())


def train(model_dir: Path, data: Path, out: Path, name: str, *flags: str) -> Path:
    command = [
        sys.executable, "-m", "engine.cli", "train", "--model", str(model_dir), "--data", str(data), "--output",
        str(out), "--name", name, "--max-steps", "2", "--data-max-seq-len", "32", "--data-tokens-per-batch", "64",
        "--json", *flags,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=HANG_S, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["kind"] == "RunFinished"
    return out / name


def test_a_run_with_its_modules_in_chunks_saves_every_adapter_weight(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    plain = train(tiny_model_dir, chat_file, tmp_path, "plain")
    expected = lora_keys(plain / "adapter" / "adapter_model.safetensors")
    assert any("self_attn" in key for key in expected)
    run = train(tiny_model_dir, chat_file, tmp_path, "chunked", "--chunked-mlp", "--checkpointing", "standard")
    assert lora_keys(run / "adapter" / "adapter_model.safetensors") == expected
    checkpoints = sorted((run / "checkpoints").glob("step-*/adapter.safetensors"))
    assert checkpoints and all(lora_keys(path) == expected for path in checkpoints)


def test_the_best_adapter_holds_every_lora_weight_while_stand_ins_are_in_place(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """adapter-best/ is written while training goes on, with the q/k/v/o projections behind chunking stand-ins:
    it holds the same tensors, by name and shape, as the final adapter and as a plain run's."""
    held = ("--eval-fraction", "0.3", "--eval-every", "1", "--early-stop", "0", "--no-keep-knowledge")
    plain = train(tiny_model_dir, chat_file, tmp_path, "plain", *held)
    run = train(tiny_model_dir, chat_file, tmp_path, "chunked", "--chunked-mlp", "--checkpointing", "standard", *held)
    assert (run / "adapter-best" / "best.json").is_file()
    shapes = {}
    for folder in (plain / "adapter", run / "adapter", run / "adapter-best"):
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as weights:
            shapes[folder] = {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118
    expected = shapes[plain / "adapter"]
    assert any("self_attn" in key for key in expected)
    assert shapes[run / "adapter-best"] == expected and shapes[run / "adapter"] == expected
