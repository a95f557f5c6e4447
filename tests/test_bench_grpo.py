"""``tunedeck bench --grpo``: TRL's GRPOTrainer and ``tunedeck train --method grpo`` on the same prompts and reward,
each in a fresh process, read back into one report with step, generation and update rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import command, grpo


def steps(ends: list[float], sampling_s: float = 0.25, tokens: int = 100, answers: int = 40) -> list[dict]:
    return [{"step": i + 1, "loss": 0.0, "tokens": tokens, "reward_mean": 0.5, "completion_length": 5.0,
             "generation_s": sampling_s, "answer_tokens": answers, "ended": t}
            for i, t in enumerate(ends)]  # fmt: skip


def test_the_rates_split_each_step_into_sampling_and_the_rest() -> None:
    figures = grpo.summarize({"steps": steps([10.0, 11.0, 11.5, 12.0, 12.5]), "peak_reserved_bytes": 2**31}, 2)
    assert figures["tokens_per_s"] == 300 / 1.5 and figures["ms_per_step"] == 500.0
    assert figures["generation_tokens_per_s"] == 120 / 0.75  # answer tokens over the sampling time
    assert figures["update_tokens_per_s"] == 300 / 0.75 and figures["sampling_share"] == 0.5
    assert figures["mean_answer_tokens"] == 5.0 and figures["peak_reserved_gib"] == 2.0


def test_a_side_without_sampling_times_gives_no_split() -> None:
    timed = steps([1.0, 2.0, 3.0])
    timed[2]["generation_s"] = None
    figures = grpo.summarize({"steps": timed}, 1)
    assert figures["tokens_per_s"] == 100.0 and "generation_tokens_per_s" not in figures


def test_tunedecks_sampling_time_comes_from_its_own_rate() -> None:
    (step,) = grpo.tunedeck_steps([{"completion_length": 6.0, "answers": 8, "generation_tokens_per_s": 96.0}])
    assert step["answer_tokens"] == 48 and step["generation_s"] == 0.5


def test_both_sides_score_with_the_same_test() -> None:
    assert grpo.has_digit("route 66") == 1.0 and grpo.has_digit("no numbers") == 0.0
    assert f"regex:{grpo.DIGIT}" in grpo.tunedeck_command(Path("m"), Path("d"), Path("o"), grpo.Workload(), [])


def test_the_bench_is_named_as_a_flag_or_as_a_word(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--grpo", "--help"], ["grpo", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            command.main(argv)
        assert exit_.value.code == 0
        assert "tunedeck bench --grpo" in capsys.readouterr().out


@pytest.mark.slow
def test_both_sides_train_the_same_prompts_in_fresh_processes(tmp_path: Path) -> None:
    """Two narrow layers on the CPU, three steps a side: both finish, sample their groups, report the three rates
    and the table gives the ratio."""
    pytest.importorskip("trl", reason="TRL is the stock side: install the test extra (pip install -e '.[test]')")
    out = tmp_path / "grpo.json"
    assert grpo.main(["--tiny", "--sides", "trl,tunedeck", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["sides"]) == {"trl", "tunedeck"}
    for name, side in report["sides"].items():
        assert side["steps"] == 3, name
        assert side["tokens_per_s"] > 0 and side["generation_tokens_per_s"] > 0, name
        assert side["update_tokens_per_s"] > side["tokens_per_s"], name  # the rest of a step is shorter than it
        assert 0 < side["mean_answer_tokens"] <= 8, name
    assert report["ratio"] == pytest.approx(
        report["sides"]["tunedeck"]["tokens_per_s"] / report["sides"]["trl"]["tokens_per_s"], rel=1e-2
    )
    assert report["settings"]["trl"]["gradient_checkpointing"] is True
    assert report["settings"]["trl"]["use_vllm"] is False
    table = out.with_suffix(".md").read_text()
    assert "| trl |" in table and "| tunedeck |" in table and "generation tokens/s" in table
