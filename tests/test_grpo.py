"""Learning from rewards (GRPO) as a user meets it: ``tunedeck train --method grpo`` on a tiny model with a regex
reward through the real command line, its logged rewards and run folder; the arithmetic of advantages and loss
variants; and the errors: bad prompt rows, a missing reward, a reward that raises (checkpoints already written stay
whole)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang import HANG_S
from helpers import write_jsonl

from engine.config import RunConfig
from engine.errors import ConfigError, DataError
from engine.events import BestAdapterKept, EvalMetrics, RunFailed, StepMetrics
from engine.rewards import RewardSpec
from engine.run import checkpoint as ckpt
from engine.run.methods.grpo_data import read_prompts
from engine.run.methods.grpo_loss import StepShape, group_advantages, step_loss
from engine.train import run

ROOT = Path(__file__).resolve().parents[1]


def tunedeck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(  # from the checkout's root, so its engine is the one that runs
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_S
    )


def prompt_rows(count: int = 6) -> list[dict[str, object]]:
    return [{"prompt": f"say a number, {i}:", "answer": str(i)} for i in range(count)]


def test_tunedeck_train_grpo_logs_rewards_and_writes_the_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows())
    result = tunedeck(
        "train", "--method", "grpo", "--model", str(tiny_model_dir), "--data", str(data), "--reward", r"regex:\d",
        "--reward", "0.5*length:1-6", "--group-size", "4", "--max-new-tokens", "6", "--max-steps", "3",
        "--grad-accum", "2", "--beta", "0.05", "--lora-rank", "4", "--eval-every", "0", "--device", "cpu",
        "--dtype", "float32", "--output", str(tmp_path / "runs"), "--name", "grpo", "--json", "--no-keep-knowledge",
        "--eval-fraction", "0.34",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if e["kind"] == "StepMetrics"]
    assert len(steps) == 3
    for step in steps:
        assert step["reward_mean"] is not None and set(step["reward_means"]) == {"regex", "length"}
        assert step["kl"] is not None and step["kl"] >= 0 and step["completion_length"] > 0
        assert step["update_tokens_per_s"] > 0 and step["generation_tokens_per_s"] > 0
    shown = [e for e in events if e["kind"] == "AnswersSampled"]
    assert [e["step"] for e in shown] == [1, 2, 3], "each step's new answers, a few of them, with their rewards"
    assert all(0 < len(e["answers"]) == len(e["rewards"]) <= 4 and e["prompt"] for e in shown)
    evaluations = [e for e in events if e["kind"] == "EvalMetrics"]
    assert evaluations and evaluations[-1]["reward_mean"] is not None, "held-out prompts scored at the end"
    folder = tmp_path / "runs" / "grpo"
    assert (folder / "adapter" / "adapter_model.safetensors").exists()
    saved = json.loads((folder / "config.json").read_text())
    assert saved["training"]["method"] == "grpo"
    assert [r["kind"] for r in saved["training"]["rewards"]] == ["regex", "length"]
    assert RunConfig.load(folder / "config.json").training.rewards[1].weight == 0.5
    report = json.loads((folder / "report.json").read_text())
    assert report["method"] == "grpo" and all(m["mean_reward"] is not None for m in report["models"])


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"answer": "1"}, "row 2: has no 'prompt' and no 'messages'"),
        ({"prompt": "  "}, "row 2, field 'prompt': must be a non-empty string"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
         "row 2, field 'messages': must end with a user turn"),
        ({"messages": [{"role": "user"}]}, "row 2, field 'messages[1]'"),
    ],
)  # fmt: skip
def test_bad_prompt_rows_are_named(tiny_model_dir: Path, tmp_path: Path, row: dict[str, object], problem: str) -> None:
    from transformers import AutoTokenizer

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(DataError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        read_prompts(str(data), AutoTokenizer.from_pretrained(tiny_model_dir))


def test_messages_prompts_open_the_assistant_turn(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"messages": [{"role": "user", "content": "two plus two?"}], "answer": "4"}]
    (prompt,) = read_prompts(str(write_jsonl(tmp_path / "m.jsonl", rows)), tokenizer)
    assert prompt.text == "two plus two?" and prompt.fields == {"answer": "4"} and prompt.number == 1
    assert tokenizer.decode(prompt.input_ids).endswith("<|im_start|>assistant\n")


def test_grpo_without_a_reward_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs at least one reward"):
        RunConfig.from_dict({"training": {"method": "grpo"}})


def test_a_reward_that_raises_stops_the_run_naming_row_and_reward(tiny_model_dir: Path, tmp_path: Path) -> None:
    reward_file = tmp_path / "picky.py"
    reward_file.write_text(
        "CALLS = []\n"
        "def reward(prompt, completion, **row):\n"
        "    CALLS.append(1)\n"
        "    if len(CALLS) > 4:  # the third step's answers\n"
        "        raise ValueError('cannot score this')\n"
        "    return float(len(completion))\n"
    )
    rows = [{"prompt": f"p{i}:", "answer": str(i)} for i in range(4)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    config = RunConfig.from_dict(
        {
            "model": {"name": str(tiny_model_dir), "dtype": "float32"},
            "data": {"path": str(data), "eval_fraction": 0.0, "max_seq_len": 64, "tokens_per_batch": 256},
            "lora": {"rank": 4},
            "training": {
                "method": "grpo", "max_steps": 8, "grad_accum": 1, "save_every": 1, "eval_every": 0,
                "device": "cpu", "group_size": 2, "max_new_tokens": 4, "keep_knowledge": False, "epochs": 1.0,
                "rewards": [RewardSpec("python", settings=(("path", str(reward_file)),)).to_json()],
            },
            "output": {"dir": str(tmp_path / "runs"), "name": "raises"},
        }
    )  # fmt: skip
    events = list(run(config))
    failed = [e for e in events if isinstance(e, RunFailed)]
    assert len(failed) == 1
    assert "row " in failed[0].message and "picky" in failed[0].message, failed[0].message
    assert failed[0].step == 2
    done = [e for e in events if isinstance(e, StepMetrics)]
    folder = tmp_path / "runs" / "raises" / "checkpoints"
    written = ckpt.list_checkpoints(folder)
    assert len(done) == 2 and len(written) == 2, "the run stopped at the third step, after two checkpoints"
    assert all(ckpt.checkpoint_problem(path) is None for path in written), "every checkpoint written is whole"


def grpo_config(model_dir: Path, data: Path, output: Path, **training: object) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": str(model_dir), "dtype": "float32"},
            "data": {"path": str(data), "eval_fraction": 0.34, "max_seq_len": 64, "tokens_per_batch": 256},
            "lora": {"rank": 4},
            "training": {
                "method": "grpo", "grad_accum": 1, "device": "cpu", "group_size": 2, "max_new_tokens": 4,
                "keep_knowledge": False, "learning_rate": 1e-2, "rewards": [{"kind": "length", "settings":
                {"min": 1, "max": 3}}], **training,
            },
            "output": {"dir": str(output), "name": "resumed"},
        }
    )  # fmt: skip


def test_a_stopped_grpo_run_resumes_and_keeps_its_best_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(6))
    config = grpo_config(tiny_model_dir, data, tmp_path / "runs", max_steps=4, save_every=1, eval_every=1)
    events = run(config)
    for event in events:  # stopped as a closed window stops it: at the second step's metrics
        assert not isinstance(event, RunFailed), event
        if isinstance(event, StepMetrics) and event.step == 2:
            break
    events.close()  # type: ignore[attr-defined]
    folder = tmp_path / "runs" / "resumed"
    assert [p.name for p in ckpt.list_checkpoints(folder / "checkpoints")] == [ckpt.checkpoint_name(1)]
    resumed = list(run(config, resume=folder))
    assert not [e for e in resumed if isinstance(e, RunFailed)], resumed
    assert [e.step for e in resumed if isinstance(e, StepMetrics)] == [2, 3, 4], "on from its checkpoint"
    rewards = [e.reward_mean for e in resumed if isinstance(e, EvalMetrics)]
    assert len(rewards) == 3 and all(r is not None for r in rewards), "held-out prompts scored by mean reward"
    assert [e for e in resumed if isinstance(e, BestAdapterKept)] or (folder / "adapter-best").exists()
    assert (folder / "adapter-best" / "adapter_model.safetensors").exists(), "the best adapter by held-out reward"


def test_advantages_follow_trl_scale_choices() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    group, _ = group_advantages(rewards, 3, "group")
    assert group[:3].tolist() == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001], abs=1e-4)
    assert group[3:].tolist() == [0.0, 0.0, 0.0], "a group of equal rewards teaches nothing"
    none, _ = group_advantages(rewards, 3, "none")
    assert none.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    batch, std = group_advantages(rewards, 3, "batch")
    assert std[0].item() == pytest.approx(rewards.std().item())
    assert batch[0].item() == pytest.approx(-1.0 / (rewards.std().item() + 1e-4))


def test_loss_variants_normalise_as_trl_names_them() -> None:
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    shape = StepShape(completions=2, tokens=6, max_new_tokens=4)
    assert step_loss(loss, mask, "grpo", shape).item() == pytest.approx((1.0 + 2.0) / 2)
    assert step_loss(loss, mask, "dapo", shape).item() == pytest.approx(8.0 / 6)
    assert step_loss(loss, mask, "bnpo", shape).item() == pytest.approx(8.0 / 6)
    assert step_loss(loss, mask, "dr_grpo", shape).item() == pytest.approx(8.0 / (2 * 4))
    halves = [step_loss(loss[i : i + 1], mask[i : i + 1], "grpo", shape) for i in range(2)]
    assert sum(h.item() for h in halves) == pytest.approx(1.5), "micro-batches add up to the step's loss"
