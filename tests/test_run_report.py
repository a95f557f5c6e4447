"""The before/after report: base and tuned side by side on the run's held-out examples and on the general text,
measured apart from the training loop and held to what the loop itself measured; written beside the run when
``tunedeck train`` ends, printed by ``tunedeck report``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import test_best_adapter
import torch
from helpers import write_jsonl
from test_best_adapter import config, finished

from engine.cli.progress import run_with_progress
from engine.cli.runs import report_main
from engine.config import RunConfig
from engine.data.packing import IGNORE_INDEX, TokenizedExample
from engine.data.prepare import prepare_data
from engine.model.load import load_tokenizer
from engine.run.control import RunControl
from engine.run.report import (
    REPORT_JSON,
    REPORT_MD,
    ModelScores,
    build_report,
    forgetting_line,
    general_text_files,
    preferred_share,
    read_report,
    report_after_run,
    write_report,
)
from engine.run.short_answers import ShortAnswer, exact_match, normalize_answer, short_answers, token_f1
from engine.train import run

fitting_model = test_best_adapter.fitting_model  # the fixtures: a tiny model LoRA fits fast, and its overfit run
overfit = test_best_adapter.overfit


def evaluations(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}


def test_the_report_holds_base_best_and_last_to_the_runs_own_evaluations(overfit: tuple[list[Any], Path]) -> None:
    _, run_dir = overfit
    report = build_report(run_dir)
    base, best, last = report.models
    done = finished(overfit[0])
    assert best.label == f"best adapter (step {done.best_step})" and last.label == f"last adapter (step {done.step})"
    recorded = evaluations(run_dir)
    assert best.held_out_loss == pytest.approx(recorded[done.best_step]["eval_loss"], rel=1e-4)
    assert last.held_out_loss == pytest.approx(recorded[done.step]["eval_loss"], rel=1e-4)
    assert best.held_out_perplexity == pytest.approx(math.exp(best.held_out_loss))
    assert base.held_out_loss is not None and abs(base.held_out_loss - best.held_out_loss) > 0.1
    assert report.held_out_examples == 8 and report.general_tokens > 2000
    assert all(m.general_perplexity > 1 for m in report.models)
    assert len({round(m.general_perplexity, 3) for m in report.models}) == 3  # the adapters changed how it reads
    table = report.markdown()
    assert "| | base model | best adapter" in table and "general-text perplexity (forgetting)" in table


def test_tunedeck_report_prints_the_written_report_and_measures_a_run_without_one(
    overfit: tuple[list[Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, run_dir = overfit
    for name in (REPORT_JSON, REPORT_MD):
        (run_dir / name).unlink(missing_ok=True)
    assert report_main([str(run_dir)]) == 0
    measured = capsys.readouterr().out
    assert measured.startswith(f"# Before and after: {run_dir.name}") and (run_dir / REPORT_MD).read_text() == measured
    saved = read_report(run_dir)
    assert saved is not None
    write_report(run_dir, type(saved)(**{**saved.__dict__, "run": "as written"}))  # printed from the file now
    assert report_main([str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "as written"


def test_the_share_preferred_compares_answers_per_token() -> None:
    # worked by hand: pair 1 sums -4 over 2 tokens (-2 each) against -6 over 4 (-1.5 each): the longer rejected
    # answer is likelier per token although its sum is lower; pair 2: -3 over 3 against -8 over 4; pair 3 a tie
    log_probs = torch.tensor([[-4.0, -6.0], [-3.0, -8.0], [-2.0, -2.0]])
    tokens = torch.tensor([[2.0, 4.0], [3.0, 4.0], [1.0, 1.0]])
    assert preferred_share(log_probs, tokens) == pytest.approx(1 / 3)
    assert preferred_share(log_probs[:1], torch.ones(1, 2)) == 1.0  # by sums, pair 1 is preferred


def per_token_log_probs(model: Any, document: TokenizedExample) -> float:
    """A document's mean log-probability of its learned tokens, by a plain forward of it alone."""
    ids = torch.tensor([list(document.input_ids)])
    labels = torch.tensor(list(document.labels))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    learned = labels[1:] != IGNORE_INDEX
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return float(picked[learned].mean())


def share_preferred(model: Any, pairs: list[Any]) -> float:
    wins = 0
    for pair in pairs:
        chosen, rejected = pair.documents()
        wins += per_token_log_probs(model, chosen) > per_token_log_probs(model, rejected)
    return wins / len(pairs)


def test_a_dpo_report_compares_the_start_with_each_adapter(fitting_model: Path, tmp_path: Path) -> None:
    from dpo_reference import preference_rows, save_starting_adapter
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = preference_rows(chat=False, count=24)
    train = write_jsonl(tmp_path / "pairs.jsonl", rows[:16])
    held_out = write_jsonl(tmp_path / "held-out-pairs.jsonl", rows[16:])
    start = save_starting_adapter(fitting_model, tmp_path / "start", trained=True)
    settings = config(fitting_model, tmp_path, method="dpo", max_steps=4, eval_every=2, learning_rate=5e-3)
    raw = settings.to_dict()
    raw["data"].update(path=str(train), eval_path=str(held_out), tokens_per_batch=128, max_seq_len=64)
    raw["model"]["adapter"] = str(start)
    done = finished(list(run(type(settings).from_dict(raw))))
    report = build_report(done.run_dir)
    before, best = report.models[:2]
    assert before.label == "starting adapter"
    # the run's own evaluation measured against the same reference (the start) as the report
    recorded = evaluations(Path(done.run_dir))[done.best_step]
    assert best.held_out_loss == pytest.approx(recorded["eval_loss"], rel=1e-4)
    assert best.reward_accuracy == pytest.approx(recorded["reward_accuracy"])
    # before the run, no reward against a reference: only what means something without one
    assert before.held_out_loss is None and before.reward_accuracy is None

    # the share preferred, from a plain transformers forward of each answer alone
    pairs = prepare_data(RunConfig.from_dict(raw).data, load_tokenizer(RunConfig.from_dict(raw).model), 42, "dpo").eval
    base = AutoModelForCausalLM.from_pretrained(fitting_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(start), adapter_name="start").eval()
    model.load_adapter(str(Path(done.run_dir) / "adapter-best"), adapter_name="best")
    expected_before = share_preferred(model, pairs)
    model.set_adapter("best")
    assert (before.preferred, best.preferred) == pytest.approx((expected_before, share_preferred(model, pairs)))
    assert before.preferred != 0.0  # not zero by construction: the model before the run, scored on its own
    table = report.markdown()
    assert "held-out pairs preferred" in table and "chance is 50%" in table
    assert f"held-out pairs preferred: {before.preferred:.0%} → {best.preferred:.0%}" in table


def test_tunedeck_train_writes_and_prints_the_report_when_a_run_ends(
    fitting_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = config(fitting_model, tmp_path, max_steps=2)
    assert run_with_progress(settings, RunControl(), resume=None, json_lines=False) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "run"
    assert "# Before and after: run" in out and (run_dir / REPORT_MD).exists() and (run_dir / REPORT_JSON).exists()


def test_the_general_text_is_a_few_thousand_tokens_of_english() -> None:
    files = general_text_files()
    assert len(files) >= 2
    words = sum(len(path.read_text(encoding="utf-8").split()) for path in files)
    assert 2000 < words < 6000


def test_a_best_adapter_from_the_last_step_is_one_column(fitting_model: Path, tmp_path: Path) -> None:
    done = finished(list(run(config(fitting_model, tmp_path, max_steps=2, eval_every=0))))
    assert done.best_step == 2
    report = build_report(done.run_dir)
    assert [m.label for m in report.models] == ["base model", "best and last adapter (step 2)"]


@pytest.mark.parametrize(
    ("prediction", "reference", "normalized", "em", "f1"),
    [
        ("The Cat!", "cat", "cat", 1.0, 1.0),
        ("  Paris  ", "paris.", "paris", 1.0, 1.0),
        ("New\tYork,  city", "new york city", "new york city", 1.0, 1.0),
        ("number one", "number two", "number one", 0.0, 0.5),
        ("red blue", "blue red", "red blue", 0.0, 1.0),
        ("red red blue", "red blue", "red red blue", 0.0, 0.8),
        ("", "paris", "", 0.0, 0.0),
        ("the", "", "", 1.0, 1.0),  # no words on either side once articles go: the same empty answer
        ("2021-03-12", "20210312", "20210312", 1.0, 1.0),
    ],
)
def test_exact_match_and_token_f1_normalise_as_squad_does(
    prediction: str, reference: str, normalized: str, em: float, f1: float
) -> None:
    assert normalize_answer(prediction) == normalized
    assert exact_match(prediction, reference) == em
    assert token_f1(prediction, reference) == pytest.approx(f1)


def example(prompt: int, *answers: int, all_tokens: bool = False) -> TokenizedExample:
    """A document of ``prompt`` untrained tokens, then for each of ``answers`` that many learned tokens and one
    untrained one (a multi-turn chat) -- every token learned with ``all_tokens``."""
    ids, labels = list(range(prompt)), [IGNORE_INDEX] * prompt
    for length in answers:
        ids += [7] * length + [9]
        labels += [7] * length + [IGNORE_INDEX]
    return TokenizedExample(tuple(ids), tuple(ids if all_tokens else labels))


@pytest.mark.parametrize(
    ("held_out", "limit", "answers", "note"),
    [
        ([], 30, [], "no held-out examples"),
        ([example(3, 2, all_tokens=True)], 30, [], "trained on all tokens"),
        ([example(3, 33)], 30, [], "none of the 1 held-out answers is 32 tokens or shorter"),
        ([example(3, 4), example(2, 33), example(5, 32)], 30, [(3, 4), (5, 32)], "2 held-out examples"),
        ([example(3, 4, 2)], 30, [(8, 2)], "1 held-out examples"),  # the last turn; earlier turns are prompt
        ([example(1, 1)] * 5, 3, [(1, 1)] * 3, "the first 3 of 5 held-out examples"),
    ],
)
def test_short_answers_are_the_last_learned_run_after_a_prompt(
    held_out: list[TokenizedExample], limit: int, answers: list[tuple[int, int]], note: str
) -> None:
    chosen, said = short_answers(held_out, limit=limit)
    assert [(len(a.prompt), len(a.answer)) for a in chosen] == answers and note in said
    assert all(isinstance(a, ShortAnswer) and set(a.answer) == {7} for a in chosen)


def test_a_run_that_learned_its_answers_says_them_and_the_base_model_does_not(
    fitting_model: Path, tmp_path: Path
) -> None:
    settings = config(fitting_model, tmp_path, data={"eval_path": str(tmp_path / "train.jsonl")})
    done = finished(list(run(settings)))
    report = build_report(done.run_dir)
    base, tuned = report.models[0], report.models[-1]
    assert report.answers_scored == 8 and "8 held-out examples" in report.answers_note
    assert tuned.exact_match == 1.0 and tuned.token_f1 == 1.0  # "number one", as trained
    assert base.exact_match is not None and base.token_f1 is not None and base.token_f1 < 1.0
    table = report.markdown()
    assert "| short answers: exact match |" in table and "| 100% |" in table
    assert "| short answers: token F1 |" in table and "Exact match and token F1: scored on 8 held-out examples" in table
    assert read_report(Path(done.run_dir)) is None  # build_report only measures; write_report writes
    write_report(done.run_dir, report)
    assert read_report(Path(done.run_dir)) == report


def test_a_run_without_short_answers_says_why_it_has_no_exact_match(fitting_model: Path, tmp_path: Path) -> None:
    long_answer = "the quick brown fox jumps over the lazy dog " * 4
    settings = config(
        fitting_model, tmp_path, max_steps=2, eval_every=0, data={"max_seq_len": 128, "tokens_per_batch": 256}
    )
    held_out = write_jsonl(
        tmp_path / "long.jsonl",
        [{"messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": long_answer}]}] * 3,
    )
    raw = settings.to_dict()
    raw["data"].update(eval_path=str(held_out))
    report = build_report(finished(list(run(type(settings).from_dict(raw)))).run_dir)
    assert report.answers_scored == 0
    assert "not scored: none of the 3 held-out answers is 32 tokens or shorter" in report.answers_note
    assert all(m.exact_match is None and m.token_f1 is None for m in report.models)
    table = report.markdown()
    assert "exact match |" not in table and "Exact match and token F1: not scored: none of the 3" in table


def test_a_report_stopped_part_way_writes_nothing_and_says_so(overfit: tuple[list[Any], Path], tmp_path: Path) -> None:
    run_dir = Path(shutil.copytree(overfit[1], tmp_path / "run"))
    for name in (REPORT_JSON, REPORT_MD):
        (run_dir / name).unlink(missing_ok=True)
    asks: list[int] = []
    outcome = report_after_run(run_dir, cancelled=lambda: asks.append(1) or len(asks) > 3)  # stops at the 4th ask
    assert len(asks) == 4 and outcome.report is None and outcome.path is None
    assert outcome.note == f"no before/after report: stopped before its end; try: tunedeck report {run_dir}"
    assert not (run_dir / REPORT_JSON).exists() and not (run_dir / REPORT_MD).exists()
    assert report_after_run(run_dir).report is not None  # the same run, not stopped, reports in full


def test_the_report_after_a_run_never_raises_and_says_how_to_try_again(tmp_path: Path) -> None:
    outcome = report_after_run(tmp_path / "not-a-run")
    assert outcome.report is None and outcome.path is None
    assert outcome.note is not None and f"try: tunedeck report {tmp_path / 'not-a-run'}" in outcome.note


@pytest.mark.parametrize(
    ("before", "after", "line"),
    [
        (18.2, 19.0, "general English perplexity: 18.2 → 19.0 (+4%): little forgotten"),
        (20.0, 18.0, "general English perplexity: 20.0 → 18.0 (-10%): nothing forgotten"),
        (20.0, 26.0, "general English perplexity: 20.0 → 26.0 (+30%): some forgotten"),
        (20.0, 60.0, "general English perplexity: 20.0 → 60.0 (+200%): much forgotten"),
    ],
)
def test_the_forgetting_check_is_said_in_words(before: float, after: float, line: str) -> None:
    base, tuned = (ModelScores("m", None, None, None, value) for value in (before, after))
    assert forgetting_line(base, tuned) == line


def test_large_perplexities_read_with_thousands_separators() -> None:
    """A model that knows no English (the demo's) reads the general text at perplexities in the millions."""
    base, tuned = (ModelScores("m", None, None, None, value) for value in (1_326_709.9, 1_714_081.0))
    assert forgetting_line(base, tuned).startswith("general English perplexity: 1,326,709.9 → 1,714,081.0 (+29%)")


def knowledge_of(right_ids: set[str], total: int = 10) -> Any:
    """Hand-made answers to ``total`` questions q0..q9, right on ``right_ids``."""
    from engine.run.knowledge import Answered, KnowledgeScores

    return KnowledgeScores(tuple(Answered(f"q{i}", "science", "", f"q{i}" in right_ids) for i in range(total)))


def test_the_knowledge_check_asks_each_column_with_its_own_adapter(
    overfit: tuple[list[Any], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base model (every adapter off) knows q0-q4; the best adapter keeps q0-q3 and learns q9; the last keeps
    q0-q2: the report's columns say so, in order, and warn about both adapters under 90%, naming the best as the one
    that kept most."""
    from engine.run import knowledge

    answers = {None: {"q0", "q1", "q2", "q3", "q4"}, "adapter_0": {"q0", "q1", "q2", "q3", "q9"},
               "adapter_1": {"q0", "q1", "q2"}}  # fmt: skip

    def ask(model: Any, tokenizer: Any, device: Any, **_: Any) -> Any:
        from peft.tuners.tuners_utils import BaseTunerLayer

        layer = next(m for m in model.modules() if isinstance(m, BaseTunerLayer))
        return knowledge_of(answers[None if layer.disable_adapters else model.active_adapter])

    monkeypatch.setattr(knowledge, "ask", ask)
    _, run_dir = overfit
    report = build_report(run_dir)
    base, best, last = report.models
    assert (report.knowledge_questions, report.knowledge_base_right) == (10, 5)
    assert (base.knowledge_kept, base.knowledge_kept_share, base.knowledge_newly) == (5, 1.0, 0)
    assert (best.knowledge_right, best.knowledge_kept, best.knowledge_newly) == (5, 4, 1)
    assert best.knowledge_kept_share == pytest.approx(0.8)
    assert (last.knowledge_kept, last.knowledge_newly) == (3, 0) and last.knowledge_kept_share == pytest.approx(0.6)
    warning = report.knowledge_warning()
    assert warning is not None and "best adapter" in warning.split(";")[1] and "(80%)" in warning
    table = report.markdown()
    assert "| knowledge kept (of the questions the base model answers right) | 100% | 80% | 60% |" in table
    assert "kept 4 of 5 facts the base model knew (80%), 1 newly right" in table


def test_no_warning_when_every_adapter_kept_nine_in_ten() -> None:
    from engine.run.report import RunReport

    def column(label: str, kept: int) -> ModelScores:
        return ModelScores(label, None, None, None, 10.0, knowledge_kept=kept, knowledge_kept_share=kept / 20)

    kept_enough = RunReport("r", "sft", 0, 0, 0, [column("base model", 20), column("best", 18), column("last", 19)],
                            knowledge_questions=300, knowledge_base_right=20)  # fmt: skip
    assert kept_enough.knowledge_warning() is None
    short = RunReport("r", "sft", 0, 0, 0, [column("base model", 20), column("best", 17), column("last", 19)],
                      knowledge_questions=300, knowledge_base_right=20)  # fmt: skip
    warning = short.knowledge_warning()
    assert (
        warning is not None and warning.startswith("knowledge lost: best 17 of 20") and "the last kept most" in warning
    )
