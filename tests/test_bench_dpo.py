"""``tunedeck bench --dpo``: TRL's DPOTrainer and ``tunedeck train --method dpo`` on the same pairs, each in a fresh
process, read back into one report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.bench import command, dpo


def steps(times: list[float], tokens: int = 100) -> list[dict]:
    return [{"step": i + 1, "loss": 0.7 - i / 100, "tokens": tokens, "reward_accuracy": 0.5, "ended": t}
            for i, t in enumerate(times)]  # fmt: skip


def test_tokens_per_second_counts_the_steps_after_the_warm_up_by_the_wall_clock() -> None:
    figures = dpo.summarize({"steps": steps([10.0, 11.0, 11.5, 12.0, 12.5]), "peak_reserved_bytes": 3 * 2**30}, 2)
    assert figures["tokens_per_s"] == 300 / 1.5 and figures["ms_per_step"] == 500.0
    assert figures["tokens_per_step"] == 100 and figures["first_loss"] == 0.7
    assert figures["mean_timed_loss"] == pytest.approx(0.67) and figures["peak_reserved_gib"] == 3.0


def test_the_bench_is_named_as_a_flag_or_as_a_word(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--dpo", "--help"], ["dpo", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            command.main(argv)
        assert exit_.value.code == 0
        assert "tunedeck bench --dpo" in capsys.readouterr().out


def test_the_pairs_have_the_workloads_lengths(tmp_path: Path) -> None:
    work = dpo.Workload(pairs=5, prompt_words=10, answer_words=(3, 6))
    dpo.write_pairs(tmp_path / "pairs.jsonl", work)
    rows = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    for row in rows:
        assert len(row["prompt"].split()) == 10 and 3 <= len(row["chosen"].split()) <= 6
        assert 3 <= len(row["rejected"].split()) <= 6


@pytest.mark.slow
def test_both_sides_train_the_same_pairs_in_fresh_processes(tmp_path: Path) -> None:
    """Two narrow layers on the CPU, three steps a side: both finish, start from ln 2 (a new adapter is the
    reference), report real tokens and a rate, and the table gives the ratio."""
    pytest.importorskip("trl", reason="TRL is the stock side: install the test extra (pip install -e '.[test]')")
    out = tmp_path / "dpo.json"
    assert dpo.main(["--tiny", "--sides", "trl,tunedeck", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["sides"]) == {"trl", "tunedeck"}
    for name, side in report["sides"].items():
        assert side["steps"] == 3, name
        assert side["tokens_per_s"] > 0 and side["tokens_per_step"] > 0, name
        assert side["first_loss"] == pytest.approx(math.log(2), abs=1e-4), name
    assert report["sides"]["tunedeck"]["timed_steps_after_first_pass"] == 0
    assert (
        report["ratio"]
        == report["ratios"]["tunedeck"]
        == pytest.approx(report["sides"]["tunedeck"]["tokens_per_s"] / report["sides"]["trl"]["tokens_per_s"], rel=1e-2)
    )
    assert report["settings"]["trl"]["reference"] == "adapter disabled"
    assert report["settings"]["trl"]["gradient_checkpointing"] is True
    table = out.with_suffix(".md").read_text()
    assert "| trl |" in table and "| tunedeck |" in table and "step-1 losses" in table
