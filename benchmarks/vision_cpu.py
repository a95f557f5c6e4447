"""A small image task on the CPU: name the colour and shape of a drawn figure, scored on unseen images.

Training images and test images are drawn with PIL (4 colours x 2 shapes, each at its own size and place, the test
ones never trained on). The model is the smallest vision-language family that builds without a download: a tiny
random Idefics3 (2 text layers of 64, one vision layer of 32). It knows nothing before training, so the score
before is the floor; what the benchmark shows is that TuneDeck's vision path learns the image-to-answer mapping
and generalises to unseen pictures. Writes vision_cpu.json and vision_cpu.md beside this script
(vision_cpu_adapt_vision.* with ``--adapt-vision``).

    python benchmarks/vision_cpu.py [--steps 80] [--adapt-vision]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's engine, and the tiny model builders of the tests

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 190, 30), "yellow": (230, 210, 20)}
SHAPES = ("square", "circle")


def draw(path: Path, colour: str, shape: str, rng: random.Random) -> None:
    from PIL import Image, ImageDraw

    size = rng.randint(32, 64)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    side = rng.randint(size // 3, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    canvas = ImageDraw.Draw(image)
    (canvas.ellipse if shape == "circle" else canvas.rectangle)((x, y, x + side, y + side), fill=COLOURS[colour])
    image.save(path)


def write_split(folder: Path, name: str, copies: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for i in range(copies):
        for colour in COLOURS:
            for shape in SHAPES:
                file = f"{name}-{colour}-{shape}-{i}.png"
                draw(folder / file, colour, shape, rng)
                user = [{"type": "image", "image": file}, {"type": "text", "text": "what is it?"}]
                answer = f"{colour} {shape}"
                rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--adapt-vision", action="store_true", help="LoRA on the vision tower and projector too")
    args = parser.parse_args()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText
    from vision_models import idefics3

    from engine.config import ModelConfig, RunConfig
    from engine.events import RunFailed, RunFinished
    from engine.run.vision_report import score
    from engine.train import run
    from engine.vision.data import load_vision_examples
    from engine.vision.model import load_processor

    work = Path(tempfile.mkdtemp(prefix="vision-cpu-"))
    model = work / "model"
    torch.manual_seed(0)
    # the task's words as single tokens; an output head at a scale where a confident answer is reachable (at
    # transformers' 0.02 the largest logit of a 64-wide head is about 1.3, a loss floor near 4.4 that LoRA on the
    # layers below cannot lower)
    words = tuple(f"{c} {s}" for c in COLOURS for s in SHAPES)
    built, processor, _ = idefics3(corpus=words, initializer_range=0.2)
    built.save_pretrained(model)
    processor.save_pretrained(model)
    train, test = write_split(work, "train", 4, 1), write_split(work, "test", 2, 2)
    config = RunConfig.from_dict({
        "model": {"name": str(model)},
        "data": {"path": str(train), "eval_path": str(test), "tokens_per_batch": 4096},
        "lora": {"rank": 16, "alpha": 32},
        "training": {"max_steps": args.steps, "learning_rate": 1e-2, "device": "cpu", "save_every": 0,
                     "eval_every": 20, "warmup_steps": 4},
        "vision": {"adapt_vision": args.adapt_vision},
        "output": {"dir": str(work / "runs"), "name": "shapes"},
    })  # fmt: skip
    began = time.perf_counter()
    events = list(run(config))
    seconds = time.perf_counter() - began
    finished = [e for e in events if isinstance(e, RunFinished)]
    if not finished:
        raise SystemExit(f"the run failed: {[e for e in events if isinstance(e, RunFailed)]}")
    tuned = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model), finished[0].adapter_dir)
    processor = load_processor(ModelConfig(name=str(model)))
    examples = load_vision_examples(test)
    before = score(tuned, processor, examples, 64 * 64, tuned=False)
    after = score(tuned, processor, examples, 64 * 64, tuned=True)
    result = {
        "task": "colour and shape of a drawn figure (4 colours x 2 shapes)",
        "model": "tiny random Idefics3 (text 2x64, initializer_range 0.2; vision 1x32), built from config",
        "train_examples": 32, "test_examples": len(examples), "steps": args.steps, "train_seconds": round(seconds, 1),
        "before": {"exact_match": before.exact_match, "token_f1": round(before.token_f1, 3)},
        "after": {"exact_match": after.exact_match, "token_f1": round(after.token_f1, 3)},
        "final_train_loss": finished[0].final_loss, "final_eval_loss": finished[0].eval_loss,
        "sample_answers_after": list(after.answers[:6]),
        "adapt_vision": args.adapt_vision,
        "command": " ".join(["python", "benchmarks/vision_cpu.py", *sys.argv[1:]]),
    }  # fmt: skip
    out = Path(__file__).with_name("vision_cpu_adapt_vision" if args.adapt_vision else "vision_cpu")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# Vision on the CPU: colour and shape\n\n`{result['command']}`\n\n"
        f"| | exact match | token F1 |\n|---|---|---|\n"
        f"| base (adapter off) | {before.exact_match:.3f} | {before.token_f1:.3f} |\n"
        f"| tuned | {after.exact_match:.3f} | {after.token_f1:.3f} |\n\n"
        f"{len(examples)} unseen test images, {args.steps} steps in {seconds:.0f} s on the CPU; "
        f"model: {result['model']}.\n"
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
