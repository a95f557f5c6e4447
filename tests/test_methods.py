"""Training methods are objects behind one interface (engine.methods): the loop, session, step, report and planner
read the method, never compare its name; each method's refused switches are a table, applied by the session."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.method_facts import (
    FACTS,
    FUSED_LOSS,
    IMAGES,
    KEEP_KNOWLEDGE,
    LATE_READOUT,
    PACKING,
    SEVERAL_GPUS,
    STEP_GRAPHS,
    SWITCHES,
    facts_for,
)
from engine.run.methods import method_for

ROOT = Path(__file__).resolve().parents[1]
READERS = [
    *sorted((ROOT / "engine" / "run").glob("*.py")),  # the methods themselves (run/methods/) may name theirs
    ROOT / "engine" / "data" / "prepare.py",
    ROOT / "engine" / "hardware" / "fit_to_data.py",
    ROOT / "engine" / "hardware" / "recipes.py",
]


def _name_comparisons(path: Path) -> list[str]:
    """Comparisons in ``path`` with a training method's name as a string on either side (``method == "dpo"``,
    ``"dpo" in ...``), as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for side in sides:
            for inner in ast.walk(side):
                if isinstance(inner, ast.Constant) and inner.value in FACTS:
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_method_name_branches_in_the_loop_session_step_report_or_planner() -> None:
    assert READERS and all(path.exists() for path in READERS)
    found = [hit for path in READERS for hit in _name_comparisons(path)]
    assert found == [], f"compare the method's facts or call the method instead: {found}"


def test_the_name_check_finds_a_branch(tmp_path: Path) -> None:
    """The check above can fail: a branch on the name is found."""
    sample = tmp_path / "sample.py"
    sample.write_text('def f(method):\n    if method == "dpo":\n        return 1\n    return "sft" in method\n')
    assert _name_comparisons(sample) == ["sample.py:2", "sample.py:4"]


REFUSALS = {
    "sft": set(),
    "dpo": {SEVERAL_GPUS, STEP_GRAPHS, FUSED_LOSS, LATE_READOUT, KEEP_KNOWLEDGE, IMAGES},
    "grpo": {SEVERAL_GPUS, STEP_GRAPHS, FUSED_LOSS, LATE_READOUT, KEEP_KNOWLEDGE, PACKING, IMAGES},
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_method_refuses_its_switches_and_says_why(name: str) -> None:
    facts = facts_for(name)
    assert set(facts.refusals) == REFUSALS[name]
    assert set(facts.refusals) <= set(SWITCHES)
    assert all(len(why) > 20 for why in facts.refusals.values()), "each refusal says why"
    assert method_for(name).name == name


def test_every_method_is_tabled_and_an_unknown_one_is_named() -> None:
    assert set(REFUSALS) <= set(FACTS)
    with pytest.raises(ValueError, match="known: sft, dpo, grpo"):
        method_for("ppo")
