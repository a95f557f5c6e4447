"""A quick test is never longer than one pass over the data: on the demo's 2,000 short examples Balanced takes
fewer than 30 steps, and Quick test takes no more than Balanced."""

from __future__ import annotations

import re
from typing import Any

pytest_plugins = ["app_fixtures"]


def steps_in(text: str) -> int:
    found = re.search(r"([\d,]+) steps", text)
    assert found is not None, f"no steps in {text!r}"
    return int(found.group(1).replace(",", ""))


def test_quick_test_takes_no_more_steps_than_one_pass_over_the_data(qtbot: Any, window: Any) -> None:
    from app_demo import prepare_demo

    prepare_demo(qtbot, window, max_steps=60)
    panel = window.setup_panel
    balanced, quick = (steps_in(panel.estimates[name].text()) for name in ("Balanced", "Quick test"))
    assert balanced < 30, "the demo's data is one pass in fewer than 30 steps"
    assert quick == balanced, f"Quick test {quick} steps, Balanced {balanced}"
    panel.choose_recipe("Quick test")
    assert panel.form.values()["training"]["max_steps"] == quick, "the run takes the steps its line says"
