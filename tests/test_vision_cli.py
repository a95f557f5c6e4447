"""``tunedeck train`` on a vision-language model folder: automatic settings, image rows, and the report after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_jsonl
from vision_models import build_vision_model, draw

from engine.cli.train import train_main
from engine.run.report import read_report


def shape_rows(folder: Path, count: int) -> Path:
    rows = []
    for i in range(count):
        colour, name = [((220, 20, 20), "red"), ((20, 20, 220), "blue")][i % 2]
        draw(folder / f"{i}.png", colour, size=(40 + i, 32))
        user = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "colour?"}]
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": name}]})
    return write_jsonl(folder / "rows.jsonl", rows)


def test_train_detects_the_vision_model_settles_its_settings_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = build_vision_model(tmp_path / "model", "gemma3")
    data = shape_rows(tmp_path, 8)
    argv = ["--model", str(model), "--data", str(data), "--device", "cpu", "--max-steps", "4",
            "--output", str(tmp_path / "runs"), "--name", "pictures",
            "--max-pixels", "4096", "--data-eval-fraction", "0.25"]  # fmt: skip
    assert train_main(argv) == 0
    out = capsys.readouterr()
    assert "padded, not packed" in out.out + out.err
    run_dir = tmp_path / "runs" / "pictures"
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["training"]["learning_rate"] > 0 and saved["lora"]["rank"] > 0  # automatic, settled and saved
    assert saved["vision"]["max_pixels"] == 4096
    report = read_report(run_dir)
    assert report is not None and report.held_out_examples == 2 and report.answers_scored == 2
    assert report.models[0].label == "base model" and len(report.models) >= 2
    assert all(m.held_out_loss is not None and m.token_f1 is not None for m in report.models)
    assert "short answers: token F1" in (run_dir / "report.md").read_text()
    from engine.cli.runs import chat_main

    capsys.readouterr()
    argv = [str(run_dir), "--image", str(tmp_path / "0.png"), "--prompt", "colour?", "--base", "--device", "cpu"]
    assert chat_main([*argv, "--max-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(">")[0] for line in lines] == ["tuned", "base"]
