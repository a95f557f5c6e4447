"""Image-and-text data: chat rows with image parts, a folder with a captions file, what is learned, bad images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import write_jsonl
from vision_models import BUILDERS, build_vision_model, draw

from engine.config import ModelConfig
from engine.data.packing import IGNORE_INDEX
from engine.errors import DataError
from engine.vision.data import DEFAULT_PROMPT, load_vision_examples
from engine.vision.encode import batch, check_images, encode
from engine.vision.images import MAX_IMAGE_PIXELS, ImageRef, fit_to_budget
from engine.vision.model import load_processor


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def processor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = build_vision_model(tmp_path_factory.mktemp(request.param), request.param)
    return load_processor(ModelConfig(name=str(folder)))


def chat_rows(folder: Path, count: int = 3) -> Path:
    (folder / "pics").mkdir(exist_ok=True)
    rows = []
    for i in range(count):
        draw(folder / "pics" / f"{i}.png", (200, 20 * i, 10))
        user = [{"type": "image", "image": f"pics/{i}.png"}, {"type": "text", "text": "what colour?"}]
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": f"red {i}"}]})
    return write_jsonl(folder / "rows.jsonl", rows)


def learned_text(processor: Any, encoded: Any) -> str:
    learned = [token for token, label in zip(encoded.input_ids, encoded.labels, strict=True) if label != IGNORE_INDEX]
    return str(processor.tokenizer.decode(learned))


def test_only_the_answer_is_learned_never_an_image_token(processor: Any, tmp_path: Path) -> None:
    examples = load_vision_examples(chat_rows(tmp_path))
    assert examples[1].images[0].path == tmp_path / "pics" / "1.png"  # relative to the data file
    encoded = encode(processor, examples[1], max_pixels=64 * 64)
    assert encoded.image_tokens > 0
    learned = learned_text(processor, encoded)
    assert learned.startswith("red 1")
    assert processor.tokenizer.eos_token in learned  # the end of the turn is learned: the model learns to stop
    assert "what colour" not in learned
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert all(label != image_id for label in encoded.labels)


def test_a_batch_pads_examples_and_keeps_their_labels(processor: Any, tmp_path: Path) -> None:
    examples = load_vision_examples(chat_rows(tmp_path))
    long = (*examples[2].messages[:-1], {"role": "assistant", "content": "red and a much longer answer here"})
    examples[2] = type(examples[2])(long, examples[2].images, examples[2].data_file, examples[2].row)
    encoded = [encode(processor, example, 64 * 64) for example in examples]
    inputs = batch(processor, encoded, 64 * 64)
    assert inputs["input_ids"].shape[0] == 3
    assert inputs["input_ids"].shape[1] == max(len(item) for item in encoded)
    for row, item in enumerate(encoded):
        assert inputs["labels"][row, : len(item)].tolist() == list(item.labels)
        assert (inputs["labels"][row, len(item) :] == IGNORE_INDEX).all()
    assert any("pixel" in key for key in inputs)


def test_a_folder_of_images_with_a_captions_file(tmp_path: Path) -> None:
    draw(tmp_path / "a.png", (255, 0, 0))
    draw(tmp_path / "b.png", (0, 0, 255), shape="circle")
    (tmp_path / "captions.csv").write_text("file_name,caption\na.png,a red square\nb.png,a blue circle\n")
    examples = load_vision_examples(tmp_path)
    assert [example.answer for example in examples] == ["a red square", "a blue circle"]
    assert examples[0].messages[0]["content"][1]["text"] == DEFAULT_PROMPT
    assert check_images(examples) == 2
    (tmp_path / "captions.csv").unlink()
    write_jsonl(tmp_path / "labels.jsonl", [{"image": "a.png", "label": "square", "question": "which shape?"}])
    (only,) = load_vision_examples(tmp_path)
    assert only.answer == "square" and only.messages[0]["content"][1]["text"] == "which shape?"


def test_a_folder_without_a_captions_file_is_refused(tmp_path: Path) -> None:
    draw(tmp_path / "a.png", (255, 0, 0))
    with pytest.raises(DataError, match="captions or labels file"):
        load_vision_examples(tmp_path)


def bad_image(tmp_path: Path, kind: str) -> None:
    if kind == "unreadable":
        (tmp_path / "pics" / "1.png").write_bytes(b"not an image at all")
    elif kind == "truncated":
        data = (tmp_path / "pics" / "1.png").read_bytes()
        (tmp_path / "pics" / "1.png").write_bytes(data[: len(data) // 2])
    elif kind == "missing":
        (tmp_path / "pics" / "1.png").unlink()
    elif kind == "enormous":
        from PIL import Image

        side = int(MAX_IMAGE_PIXELS**0.5) + 8
        Image.new("1", (side, side)).save(tmp_path / "pics" / "1.png")  # 1-bit: a few kilobytes on disk


@pytest.mark.parametrize(
    ("kind", "message"),
    [("missing", "no such file"), ("unreadable", "not an image"), ("truncated", "cannot be decoded"),
     ("enormous", "is enormous")],
)  # fmt: skip
def test_a_bad_image_stops_before_training_naming_file_row_and_image(tmp_path: Path, kind: str, message: str) -> None:
    rows = chat_rows(tmp_path)
    bad_image(tmp_path, kind)
    examples = load_vision_examples(rows)
    with pytest.raises(DataError, match=message) as caught:
        check_images(examples)
    text = str(caught.value)
    assert f"file {rows}" in text and "row 2" in text and "'pics/1.png'" in text


def test_an_image_over_the_budget_is_scaled_down_keeping_its_shape() -> None:
    from PIL import Image

    image = fit_to_budget(Image.new("RGB", (400, 200)), 20_000)
    assert image.size[0] * image.size[1] <= 20_000
    assert image.size == (200, 100)
    small = Image.new("RGB", (10, 10))
    assert fit_to_budget(small, 20_000) is small


@pytest.mark.parametrize(
    ("row", "message"),
    [({"messages": []}, "non-empty"), ({"messages": [{"role": "user", "content": "hi"}]}, "assistant's answer"),
     ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
      "file path"),
     ({"messages": [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]}, "user turns")],
)  # fmt: skip
def test_malformed_rows_are_refused_with_their_row(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n" + json.dumps(row) + "\n")  # fmt: skip
    with pytest.raises(DataError, match=message) as caught:
        load_vision_examples(path)
    assert "row 2" in str(caught.value)


def test_image_refs_name_where_they_came_from(tmp_path: Path) -> None:
    error = ImageRef(tmp_path / "x.png", "rows.jsonl", 7, "x.png").problem("broken")
    assert str(error).startswith("file rows.jsonl, row 7: image 'x.png'")


def test_a_large_jpeg_decodes_smaller_and_fits_the_budget_as_a_whole_decode_would(tmp_path: Path) -> None:
    from PIL import Image

    from engine.vision.images import load_image

    path = tmp_path / "photo.jpg"
    Image.new("RGB", (1600, 1200), (200, 120, 40)).save(path, quality=90)
    fitted = load_image(ImageRef(path, "rows.jsonl", 1, "photo.jpg"), 160 * 120)
    whole = fit_to_budget(Image.open(path).convert("RGB"), 160 * 120)
    assert fitted.size == whole.size == (160, 120)
    assert max(abs(a - b) for a, b in zip(fitted.getpixel((80, 60)), whole.getpixel((80, 60)), strict=True)) <= 4


def test_the_image_cache_keeps_fitted_pictures_up_to_its_budget(tmp_path: Path) -> None:
    from engine.vision.images import ImageCache

    first_ref = ImageRef(draw(tmp_path / "a.png", (255, 0, 0)), "rows.jsonl", 1, "a.png")
    second_ref = ImageRef(draw(tmp_path / "b.png", (0, 0, 255)), "rows.jsonl", 2, "b.png")
    cache = ImageCache(max_pixels=400, max_bytes=400 * 3)  # room for one fitted picture
    first = cache.load(first_ref)
    assert first.size[0] * first.size[1] <= 400 and cache.load(first_ref) is first
    second = cache.load(second_ref)
    again = cache.load(second_ref)
    assert again is not second and again.tobytes() == second.tobytes()  # no room: loaded each time, the same
