"""The built-in demo: task generator, shipped model and tokenizer, dataset files, and the accuracy measure."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang import HANG_S
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engine import demo

MONTH = "|".join(demo.MONTHS)
ABBR = "|".join(demo.MONTH_ABBREVIATIONS)
# Each surface form the prompts may use, as (pattern, strptime format); parsed with the standard library so the
# generator's answers are checked by code that does not share its logic.
DATE_PATTERNS = (
    (rf"(?:{MONTH}) \d{{1,2}}, \d{{4}}", "%B %d, %Y"),
    (rf"\d{{1,2}} (?:{MONTH}) \d{{4}}", "%d %B %Y"),
    (rf"(?:{ABBR}) \d{{1,2}} \d{{4}}", "%b %d %Y"),
    (rf"(?:{ABBR}) \d{{1,2}}, \d{{4}}", "%b %d, %Y"),
    (r"\d\d/\d\d/\d{4}(?= \(day first\))", "%d/%m/%Y"),
    (r"\d\d/\d\d/\d{4}(?= \(month first\))", "%m/%d/%Y"),
)


def parse_prompt_date(prompt: str) -> dt.date:
    """The single date a prompt mentions, found by every pattern that matches (they must agree)."""
    text = re.sub(r"\b(\d{1,2})(?:st|nd|rd|th)\b", r"\1", prompt)  # "5th March" -> "5 March"
    found = {
        dt.datetime.strptime(match, fmt).date() for pattern, fmt in DATE_PATTERNS for match in re.findall(pattern, text)
    }
    assert len(found) == 1, f"expected exactly one date in {prompt!r}, found {found}"
    return found.pop()


def load_rows(path: Path) -> list[demo.Row]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(demo.DEMO_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(demo.DEMO_MODEL_DIR, local_files_only=True, dtype=torch.float32)


def test_generator_is_deterministic_and_seed_dependent() -> None:
    assert demo.make_demo_examples(40, seed=3) == demo.make_demo_examples(40, seed=3)
    assert demo.make_demo_examples(40, seed=3) != demo.make_demo_examples(40, seed=4)


def test_generator_answers_are_correct_iso_dates() -> None:
    rows = demo.make_demo_examples(400, seed=11)
    for row in rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert assistant["content"] == parse_prompt_date(user["content"]).isoformat()


def test_generator_uses_every_style_and_never_repeats_a_day() -> None:
    rows = demo.make_demo_examples(400, seed=11)
    answers = [demo.reference_answer(row) for row in rows]
    assert len(set(answers)) == len(answers)
    prompts = " ".join(row["messages"][0]["content"] for row in rows)
    assert "(day first)" in prompts and "(month first)" in prompts and "th " in prompts


ORDINALS = {
    1: "1st",
    2: "2nd",
    3: "3rd",
    4: "4th",
    11: "11th",
    12: "12th",
    13: "13th",
    21: "21st",
    22: "22nd",
    31: "31st",
}


def test_generator_rejects_more_rows_than_days() -> None:
    with pytest.raises(ValueError, match="one row per day"):
        demo.make_demo_examples(10**6, seed=0)


@pytest.mark.parametrize(("day", "text"), sorted(ORDINALS.items()))
def test_ordinal(day: int, text: str) -> None:
    assert demo.ordinal(day) == text


def test_shipped_files_exist_and_are_small() -> None:
    files = list(demo.DEMO_MODEL_DIR.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    assert not any(f.suffix in {".bin", ".pt"} for f in files)
    assert sum(f.stat().st_size for f in files) <= 8 * 2**20


def test_shipped_dataset_is_held_out_and_correct() -> None:
    train, held_out = load_rows(demo.DEMO_TRAIN_FILE), load_rows(demo.DEMO_EVAL_FILE)
    assert len(train) >= 1000 and len(held_out) >= 64
    train_answers = {demo.reference_answer(row) for row in train}
    assert not train_answers & {demo.reference_answer(row) for row in held_out}
    for row in train[:200] + held_out:
        assert demo.reference_answer(row) == parse_prompt_date(row["messages"][0]["content"]).isoformat()


def test_tokenizer_renders_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tokenizer_splits_digits_and_round_trips(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer("2021", add_special_tokens=False)["input_ids"]) == 4
    text = "Convert to ISO date: 5th March 2021 -> 2021-03-05"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_model_matches_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    assert model.config.model_type == "llama"
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert model.config.tie_word_embeddings


def test_base_model_cannot_do_the_task(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    rows = load_rows(demo.DEMO_EVAL_FILE)[:32]
    accuracy = demo.evaluate_accuracy(model, tokenizer, rows)
    assert isinstance(accuracy, float)
    assert 0.0 <= accuracy <= 0.1


def test_batched_generation_matches_one_row_at_a_time(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Left padding must not change any answer: the batched path and the unpadded path agree."""
    rows = load_rows(demo.DEMO_EVAL_FILE)[:6]
    batched = demo.generate_answers(model, tokenizer, rows, batch_size=6)
    single = demo.generate_answers(model, tokenizer, rows, batch_size=1)
    assert batched == single


def test_accuracy_works_on_a_peft_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """A fresh LoRA adapter starts as a no-op, so the wrapped model must answer exactly like the base model."""
    from peft import LoraConfig, get_peft_model

    rows = load_rows(demo.DEMO_EVAL_FILE)[:8]
    expected = demo.generate_answers(model, tokenizer, rows)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    try:
        peft_model.train()
        assert demo.generate_answers(peft_model, tokenizer, rows) == expected
        assert 0.0 <= demo.evaluate_accuracy(peft_model, tokenizer, rows) <= 1.0
        assert peft_model.training  # the caller's mode is restored
    finally:
        peft_model.unload()  # leave the shared module-scoped model as it was


def test_accuracy_counts_exact_matches(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Rows whose reference is the model's own answer score 1.0; an impossible reference scores 0.0."""
    rows = load_rows(demo.DEMO_EVAL_FILE)[:4]
    answers = demo.generate_answers(model, tokenizer, rows)
    echoed = [
        {"messages": [row["messages"][0], {"role": "assistant", "content": f" {a} "}]}
        for row, a in zip(rows, answers, strict=True)
    ]
    assert demo.evaluate_accuracy(model, tokenizer, echoed) == 1.0
    impossible = [{"messages": [row["messages"][0], {"role": "assistant", "content": "\x00"}]} for row in rows]
    assert demo.evaluate_accuracy(model, tokenizer, impossible) == 0.0


def test_accuracy_rejects_no_rows(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="zero rows"):
        demo.evaluate_accuracy(model, tokenizer, [])


def test_build_script_has_help() -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "build_demo.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    assert "--steps" in result.stdout
