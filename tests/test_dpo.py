"""DPO: preference data in its common shapes, pairs packed as two documents, TRL's losses, the kept reference
log-probabilities, starting from an earlier adapter, QLoRA, and a run through ``tunedeck train --method dpo``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hang import HANG_S
from helpers import write_jsonl

from engine.config import DataConfig, DpoConfig, ModelConfig, OutputConfig, RunConfig
from engine.data.files import PreferencePair, iter_row_problems, load_examples
from engine.data.packing import IGNORE_INDEX, TokenizedPair, collate
from engine.data.prepare import prepare_data
from engine.data.tokenize import ensure_chat_template, tokenize_examples, tokenize_pair
from engine.errors import ConfigError, DataError
from engine.events import Notice, RunFailed, RunFinished, StepMetrics
from engine.model.load import add_lora, load_base_model, load_tokenizer
from engine.run import preference_step
from engine.run.checkpoint import checkpoint_name
from engine.run.folder import new_run_dir
from engine.run.preference import REFERENCE_NOTE, document_log_probs, pair_losses
from engine.speed.warm_up import WarmUpLedger
from engine.train import run

TEXT_ROWS = [{"prompt": f"say {i}: ", "chosen": f"number {i}", "rejected": f"the fox {i} jumps"} for i in range(12)]
USER = {"role": "user", "content": "what colour is the sky?"}


def chat_row(chosen: str, rejected: str) -> dict[str, Any]:
    return {
        "chosen": [USER, {"role": "assistant", "content": chosen}],
        "rejected": [USER, {"role": "assistant", "content": rejected}],
    }


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    loaded = load_tokenizer(ModelConfig(name=str(tiny_model_dir)))
    ensure_chat_template(loaded)
    return loaded


# --- data ------------------------------------------------------------------------------------------------------


def test_text_pairs_are_detected_and_read(tmp_path: Path) -> None:
    (pair, *_), fmt = load_examples(write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS))
    assert fmt == "preference"
    assert pair == PreferencePair("say 0: ", "number 0", "the fox 0 jumps") and not pair.is_chat


def test_chat_pairs_take_their_shared_turns_as_the_prompt(tmp_path: Path) -> None:
    (pair,), fmt = load_examples(write_jsonl(tmp_path / "p.jsonl", [chat_row("blue", "green")]))
    assert fmt == "preference" and pair.is_chat
    assert [m.content for m in pair.prompt] == [USER["content"]]
    assert [(m.role, m.content) for m in pair.chosen] == [("assistant", "blue")]
    assert [(m.role, m.content) for m in pair.rejected] == [("assistant", "green")]


def test_chat_pairs_with_an_explicit_prompt(tmp_path: Path) -> None:
    row = {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "blue"}],
        "rejected": [{"role": "assistant", "content": "green"}],
    }
    (pair,), _ = load_examples(write_jsonl(tmp_path / "p.jsonl", [row]))
    assert [m.content for m in pair.prompt] == [USER["content"]] and pair.chosen[0].content == "blue"


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ({"prompt": "q", "chosen": "a", "rejected": None}, "rejected", "missing"),
        ({"chosen": "a", "rejected": "b"}, "prompt", "missing"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "rejected", "nothing to prefer"),
        ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "chosen", "empty"),
        ({"prompt": "q", "chosen": "a", "rejected": [USER]}, "rejected", "both must be message lists"),
        (
            {
                "chosen": [{"role": "assistant", "content": "x"}],
                "rejected": [USER, {"role": "assistant", "content": "y"}],
            },
            "prompt",
            "share no first turn",
        ),
        ({"chosen": [USER, USER], "rejected": [USER, {"role": "assistant", "content": "y"}]}, "chosen", "assistant"),
        ({"chosen": [USER, {"role": "robot", "content": "y"}], "rejected": [USER]}, "chosen[2].role", "unknown role"),
    ],
)
def test_bad_rows_are_named_by_row_and_field(tmp_path: Path, row: dict[str, Any], field: str, words: str) -> None:
    rows = [TEXT_ROWS[0], TEXT_ROWS[1], row]
    problems = list(iter_row_problems(rows, "preference"))
    assert [(number, name) for number, name, _ in problems] == [(3, field)]
    assert words in problems[0][2]
    with pytest.raises(DataError) as caught:
        load_examples(write_jsonl(tmp_path / "bad.jsonl", rows), "preference")
    assert "row 3" in str(caught.value) and field in str(caught.value)


def test_the_data_page_previews_pairs_and_lists_bad_rows(tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.run.data_report import analyze_dataset

    rows = [*TEXT_ROWS[:3], {"prompt": "q", "chosen": "a"}, {"prompt": "q", "chosen": "a", "rejected": "a"}]
    report = analyze_dataset(str(write_jsonl(tmp_path / "p.jsonl", rows)), str(tiny_model_dir))
    assert report.data_format == "preference" and report.good_rows == 3
    assert [(row, field) for row, field, _ in report.problems] == [(4, "rejected"), (5, "rejected")]
    learned = [text for text, trained in report.preview[0] if trained]
    assert learned == [" number 0<|im_end|>", " the fox 0 jumps<|im_end|>"]  # both answers, prompts not learned


def test_the_data_must_suit_the_method(tmp_path: Path, tokenizer: Any, chat_file: Path) -> None:
    pairs = write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS)
    with pytest.raises(DataError, match="preference pairs") as caught:
        prepare_data(DataConfig(path=str(pairs), max_seq_len=32, tokens_per_batch=64), tokenizer, 0)
    assert caught.value.hint is not None and "--method dpo" in caught.value.hint
    with pytest.raises(DataError, match="DPO needs preference pairs"):
        prepare_data(DataConfig(path=str(chat_file), max_seq_len=32, tokens_per_batch=64), tokenizer, 0, "dpo")
    with pytest.raises(ConfigError, match="both answers") as caught:
        prepare_data(DataConfig(path=str(pairs), max_seq_len=16, tokens_per_batch=20), tokenizer, 0, "dpo")
    assert caught.value.hint is not None and "--tokens-per-batch" in caught.value.hint


def test_a_text_pair_is_two_documents_learning_only_the_answers(tokenizer: Any) -> None:
    pair = tokenize_pair(tokenizer, PreferencePair("say 3: ", "number 3", "the fox"))
    prompt = tokenizer("say 3: ")["input_ids"]
    for document, answer in zip(pair.documents(), ("number 3", "the fox"), strict=True):
        assert tokenizer.decode(list(document.input_ids)) == "say 3: " + answer + tokenizer.eos_token  # TRL adds EOS
        cut = next(i for i, label in enumerate(document.labels) if label != IGNORE_INDEX)
        # the answer starts where the prompt's own tokens stop matching (a token may straddle the boundary)
        assert 0 < cut <= len(prompt) and list(document.input_ids[:cut]) == prompt[:cut]
        assert all(label != IGNORE_INDEX for label in document.labels[cut:])
        assert tokenizer.decode(list(document.input_ids[cut:])).endswith(answer + tokenizer.eos_token)
    chosen, rejected = pair.documents()
    assert pair.chosen_length == len(chosen) and len(pair) == len(chosen) + len(rejected)


def test_a_chat_pair_learns_the_assistant_turn(tokenizer: Any) -> None:
    (pair,), _ = tokenize_examples(tokenizer, [_chat_pair()], max_seq_len=128)
    assert isinstance(pair, TokenizedPair)
    chosen, _ = pair.documents()
    learned = [t for t, label in zip(chosen.input_ids, chosen.labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "blue<|im_end|>\n"


def _chat_pair() -> PreferencePair:
    from engine.data.files import Message

    return PreferencePair((Message("user", "sky?"),), (Message("assistant", "blue"),), (Message("assistant", "no"),))


def test_overlong_pairs_are_cut_per_answer_or_dropped(tokenizer: Any) -> None:
    long_pair = PreferencePair("say: ", "number " * 30, "fox")
    kept, report = tokenize_examples(tokenizer, [long_pair], max_seq_len=16)
    assert report.truncated == 1 and all(len(d) <= 16 for d in kept[0].documents())  # type: ignore[attr-defined]
    dropped, report = tokenize_examples(tokenizer, [long_pair], max_seq_len=16, overlong="drop")
    assert dropped == [] and report.dropped_overlong == 1
    no_answer_left = PreferencePair("say " * 40, "number", "fox")
    gone, report = tokenize_examples(tokenizer, [no_answer_left], max_seq_len=16)
    assert gone == [] and report.dropped_untrained == 1


def test_collated_pairs_restart_positions_at_every_answer(tokenizer: Any) -> None:
    pairs = [tokenize_pair(tokenizer, PreferencePair(f"say {i}: ", "number", "fox")) for i in range(2)]
    batch = collate(pairs)
    lengths = [len(d) for p in pairs for d in p.documents()]
    assert batch.doc_lengths == tuple(lengths) and batch.num_documents == 4
    starts = batch.cu_seqlens[:-1].tolist()
    assert all(batch.position_ids[0, s] == 0 for s in starts)
    assert batch.trained_tokens == sum(p.trained_tokens for p in pairs)


# --- loss ------------------------------------------------------------------------------------------------------


def test_losses_are_trls_formulas() -> None:
    policy = torch.tensor([[-4.0, -6.0], [-5.0, -3.0]])
    reference = torch.tensor([[-5.0, -5.0], [-5.0, -5.0]])
    tokens = torch.tensor([[2.0, 4.0], [1.0, 1.0]])
    beta = 0.1  # margins (chosen − ref) − (rejected − ref): +2 and −2, so beta times them: +0.2 and −0.2
    # worked by hand: sigmoid log(1 + e^∓0.2); hinge max(0, 1 ∓ 0.2); IPO on per-token averages, whose margins are
    # (1/2 − (−1/4)) = 0.75 and (0 − 2) = −2, against 1/(2 beta) = 5
    expected = {
        "sigmoid": [0.5981388693815918, 0.7981388693815918],
        "hinge": [0.8, 1.2],
        "ipo": [(0.75 - 5) ** 2, (-2 - 5) ** 2],
    }
    for loss, values in expected.items():
        assert pair_losses(policy, reference, beta, loss, tokens).tolist() == pytest.approx(values, abs=1e-6), loss
    assert float(pair_losses(policy, reference, 2.0, "hinge", tokens)[0]) == 0.0  # a margin past 1/beta costs nothing
    assert math.isclose(float(pair_losses(reference, reference, beta, "sigmoid", tokens)[0]), math.log(2), rel_tol=1e-6)


def test_packed_answers_score_as_if_each_ran_alone(tiny_model_dir: Path, tokenizer: Any) -> None:
    model = add_lora(
        load_base_model(ModelConfig(name=str(tiny_model_dir)), torch.device("cpu"), torch.float32),
        RunConfig().lora,
        qlora=False,
    ).eval()
    pairs = [tokenize_pair(tokenizer, PreferencePair(f"say {i}: ", f"number {i}", "the fox jumps")) for i in range(2)]
    packed = collate(pairs)
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    with torch.no_grad():
        together = document_log_probs(model, inputs, packed)
        alone = []
        for document in (d for p in pairs for d in p.documents()):
            single = collate([document])
            single_inputs = {"input_ids": single.input_ids, "position_ids": single.position_ids, "use_cache": False}
            alone.append(float(document_log_probs(model, single_inputs, single)[0]))
    assert torch.allclose(together, torch.tensor(alone), atol=1e-5)


def test_beta_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"dpo\.beta"):
        DpoConfig(beta=0.0)
    assert DpoConfig().beta == 0.1 and DpoConfig().loss == "sigmoid"  # TRL's defaults


# --- runs ------------------------------------------------------------------------------------------------------


def dpo_config(model_dir: Path, data: Path, output: Path, **training: Any) -> RunConfig:
    model = {"name": str(model_dir), **training.pop("model", {})}
    output_settings = training.pop("output_settings", {})
    return RunConfig.from_dict(
        {
            "model": model,
            "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 64, "eval_fraction": 0.0},
            "training": {"method": "dpo", "learning_rate": 5e-3, "warmup_steps": 0, "seed": 3, **training},
            "output": {"dir": str(output), **output_settings},
        }
    )


def events_of(config: RunConfig) -> list[Any]:
    events = list(run(config))
    assert not any(isinstance(e, RunFailed) for e in events), [e for e in events if isinstance(e, RunFailed)]
    return events


def test_reference_log_probs_are_computed_once_per_pair(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS[:6])
    reference_documents: list[int] = []
    original = preference_step.document_log_probs

    def counted(model: Any, inputs: dict[str, Any], batch: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the reference pass (no evaluation in this run)
            reference_documents.append(batch.num_documents)
        return original(model, inputs, batch)

    monkeypatch.setattr(preference_step, "document_log_probs", counted)
    ticks: list[int] = []  # micro-batches the warm-up clock counted (compile costs are measured from them)
    original_tick = WarmUpLedger.tick

    def tick(ledger: WarmUpLedger, *args: Any) -> None:
        ticks.append(1)
        original_tick(ledger, *args)

    monkeypatch.setattr(WarmUpLedger, "tick", tick)
    events = events_of(dpo_config(tiny_model_dir, data, tmp_path / "runs", epochs=3.0, eval_every=0))
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert steps[-1].epoch == pytest.approx(3.0)
    assert sum(reference_documents) == 2 * 6  # each pair's two answers once, not once per pass
    assert len(ticks) == len(steps)  # one micro-batch a step here: reference passes are not micro-batches
    assert steps[-1].loss < steps[0].loss and steps[-1].reward_accuracy == 1.0


@pytest.fixture(scope="module")
def preferring_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(pairs, the folder of a run whose adapter learned to prefer their chosen answers)."""
    folder = tmp_path_factory.mktemp("preferring")
    data = write_jsonl(folder / "p.jsonl", TEXT_ROWS)
    first = events_of(dpo_config(tiny_model_dir, data, folder / "a", max_steps=4))
    return data, Path(next(e for e in first if isinstance(e, RunFinished)).run_dir)


def test_a_run_from_an_earlier_adapter_measures_against_it(
    tiny_model_dir: Path, tmp_path: Path, preferring_adapter: tuple[Path, Path]
) -> None:
    data, earlier = preferring_adapter
    config = dpo_config(
        tiny_model_dir, data, tmp_path / "b", max_steps=1, learning_rate=1e-9, model={"adapter": str(earlier)}
    )
    events = events_of(config)
    notices = [e.message for e in events if isinstance(e, Notice)]
    assert any("starting from the adapter" in n for n in notices) and any(REFERENCE_NOTE in n for n in notices)
    (step,) = [e for e in events if isinstance(e, StepMetrics)]
    # the reference is the model the run starts from: its first step has nothing won yet
    assert step.reward_margin == pytest.approx(0.0, abs=1e-6) and step.loss == pytest.approx(math.log(2), abs=1e-6)
    based = dataclasses.replace(config, dpo=DpoConfig(reference="base"), output=OutputConfig(dir=str(tmp_path / "c")))
    (from_base,) = [e for e in events_of(based) if isinstance(e, StepMetrics)]
    # against the base model, the adapter that learned to prefer the chosen answers starts ahead
    assert from_base.reward_margin is not None and from_base.reward_margin > 0.05 and from_base.loss < math.log(2)
    # resumed before its first checkpoint, a run starts from the adapter too (not from a fresh one)
    (resumed,) = [e for e in run(based, resume=new_run_dir(based)) if isinstance(e, StepMetrics)]
    assert resumed.reward_margin == pytest.approx(from_base.reward_margin, abs=1e-4)
    missing = list(run(dpo_config(tiny_model_dir, data, tmp_path / "d", model={"adapter": str(tmp_path / "none")})))
    assert isinstance(missing[-1], RunFailed) and "no such folder" in missing[-1].message


def _resume_from_step_2(config: RunConfig, run_dir: Path, old_checkpoint: bool = False) -> list[Any]:
    """Resume ``run_dir`` from its step-2 checkpoint (the later ones taken away); ``old_checkpoint``: as if written
    before checkpoints kept DPO's reference log-probabilities."""
    checkpoints = run_dir / "checkpoints"
    for later in [c for c in checkpoints.iterdir() if c.name != checkpoint_name(2)]:
        shutil.rmtree(later)
    if old_checkpoint:
        kept = checkpoints / checkpoint_name(2)
        (kept / "reference.safetensors").unlink()
        manifest = json.loads((kept / "manifest.json").read_text())
        del manifest["reference.safetensors"]
        (kept / "manifest.json").write_text(json.dumps(manifest))
    events = list(run(config, resume=run_dir))
    assert not any(isinstance(e, RunFailed) for e in events), events
    return events


def test_a_resumed_run_keeps_the_reference_it_started_with(
    tiny_model_dir: Path, tmp_path: Path, preferring_adapter: tuple[Path, Path]
) -> None:
    data, earlier = preferring_adapter
    config = dpo_config(
        tiny_model_dir, data, tmp_path / "runs", max_steps=4, save_every=2, model={"adapter": str(earlier)},
        output_settings={"keep_checkpoints": 3},
    )  # fmt: skip
    events = events_of(config)
    whole = [e for e in events if isinstance(e, StepMetrics)]
    run_dir = Path(next(e for e in events if isinstance(e, RunFinished)).run_dir)
    assert (run_dir / "checkpoints" / checkpoint_name(2) / "reference.safetensors").exists()
    resumed = [e for e in _resume_from_step_2(config, run_dir) if isinstance(e, StepMetrics)]
    assert [s.step for s in resumed] == [3, 4]
    for again, first in zip(resumed, whole[2:], strict=True):  # measured against the start, not the step-2 model
        assert again.reward_margin == pytest.approx(first.reward_margin, abs=1e-5)
        assert again.loss == pytest.approx(first.loss, abs=1e-5)
    assert abs(whole[2].reward_margin or 0.0) > 1e-2, "two steps moved the rewards: a comparison that can fail"
    older = _resume_from_step_2(config, run_dir, old_checkpoint=True)
    assert any(isinstance(e, Notice) and "keeps no reference log-probabilities" in e.message for e in older)
    assert [e.step for e in older if isinstance(e, StepMetrics)] == [3, 4]


def test_qlora_dpo_trains(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    data = write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS[:4])
    events = events_of(
        dpo_config(tiny_model_dir, data, tmp_path / "runs", max_steps=2, model={"qlora": True, "dtype": "bfloat16"})
    )
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert len(steps) == 2 and all(math.isfinite(s.loss) and s.rewards_chosen is not None for s in steps)


def test_tunedeck_train_method_dpo(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", [chat_row(f"blue {i}", f"green {i}") for i in range(10)])
    result = subprocess.run(
        [
            sys.executable, "-m", "engine.cli", "train", "--method", "dpo", "--dpo-beta", "0.2", "--dpo-loss", "ipo",
            "--model", str(tiny_model_dir), "--data", str(data), "--output", str(tmp_path), "--name", "dpo",
            "--max-steps", "3", "--max-seq-len", "48", "--tokens-per-batch", "96", "--eval-fraction", "0.2",
            "--step-readout", "late", "--json",
        ],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    notices = [e["message"] for e in events if e["kind"] == "Notice"]
    assert any("beta 0.2, ipo loss" in n for n in notices)
    assert any("DPO reads the step's rewards" in n for n in notices)  # late readout asked for, and why not
    speed = next(e["state"] for e in events if e["kind"] == "SpeedChanged")
    assert not speed["fused_loss"]["on"] and "DPO" in speed["fused_loss"]["reason"]
    assert not speed["step_graphs"]["on"]  # (on a GPU its reason names DPO too: tests/test_dpo_gpu.py)
    logged = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]
    for record in logged:
        assert record["reward_margin"] == pytest.approx(record["rewards_chosen"] - record["rewards_rejected"])
        assert 0.0 <= record["reward_accuracy"] <= 1.0
    evaluation = json.loads((tmp_path / "dpo" / "eval.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= evaluation["reward_accuracy"] <= 1.0 and evaluation["eval_loss"] > 0
    assert [e for e in events if e["kind"] == "EvalMetrics"][-1]["reward_accuracy"] == evaluation["reward_accuracy"]
    saved = json.loads((tmp_path / "dpo" / "config.json").read_text())
    assert saved["training"]["method"] == "dpo" and saved["dpo"] == {"beta": 0.2, "loss": "ipo", "reference": "start"}
    assert (tmp_path / "dpo" / "adapter" / "adapter_model.safetensors").exists()


def test_the_progress_printer_shows_the_rewards() -> None:
    import io

    from engine.cli.progress import ProgressPrinter
    from engine.events import EvalMetrics

    stream = io.StringIO()
    ProgressPrinter(stream).handle(EvalMetrics(step=4, loss=0.5, tokens=40, reward_accuracy=0.75))
    assert "step 4: eval loss 0.5000, reward accuracy 75%" in stream.getvalue()
    stream = io.StringIO()
    ProgressPrinter(stream).handle(EvalMetrics(step=4, loss=0.5, tokens=40))
    assert stream.getvalue().strip() == "step 4: eval loss 0.5000"
