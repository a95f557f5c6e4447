"""The Dataset page's report of an image dataset: bad images listed with their rows, image tokens counted, a preview
with thumbnails and the learned text."""

from __future__ import annotations

from pathlib import Path

from test_vision_train import colour_rows
from vision_models import build_vision_model

from engine.run.data_report import analyze_dataset


def test_an_image_dataset_report_lists_bad_images_and_counts_image_tokens(tmp_path: Path) -> None:
    model = build_vision_model(tmp_path / "model", "qwen2_5_vl")
    rows = colour_rows(tmp_path)
    (tmp_path / "blue.png").write_bytes(b"not a picture")
    report = analyze_dataset(str(rows), str(model))
    assert (report.rows, report.good_rows, report.images) == (4, 3, 3)
    ((row, field, message),) = report.problems
    assert row == 2 and field == "image" and "'blue.png'" in message and "not an image" in message
    assert 0 < report.image_tokens < report.total_tokens
    assert report.thumbnails[0] == [str(tmp_path / "red.png")]
    pieces = report.preview[0]
    assert any(text.startswith("[image: ") and not learned for text, learned in pieces)
    assert "".join(text for text, learned in pieces if learned).startswith("red")


def test_the_preview_shows_the_thumbnails_beside_the_text(tmp_path: Path) -> None:
    from app.pages.data import preview_html

    page = preview_html([("colour?", False), ("red", True)], [str(tmp_path / "red.png")])
    assert "<img src='file://" in page and "red.png" in page and "red</span>" in page
    assert "<img" not in preview_html([("text only", True)])
