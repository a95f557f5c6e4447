"""Stock transformers + peft against TuneDeck on a vision-language model of the Qwen2.5-VL-3B shape: tokens/s and
peak memory, side by side, with activation recompute and without.

The model is built from its config with random weights (no download) and saved with a processor (a small
tokenizer carrying Qwen-VL's image tokens, Qwen-VL's own image processor); the data are PIL-drawn pictures of
448x448 pixels (256 image tokens each) with a question and a short answer. Both sides train LoRA r16 on every
linear layer of the language model, the vision tower frozen, bf16, AdamW, on the same examples in micro-batches of
``--batch`` padded rows; each side runs in its own process, so neither sees the other's allocator. Stock is the loop
of the transformers/peft tutorials: the model in training mode, the processor's padded batch,
``model(**batch, labels=...)`` and ``loss.backward()``. TuneDeck is ``tunedeck train --json`` on the same folder and
data, in a fresh process with the user's environment. Two pairs: with recompute (stock's
``gradient_checkpointing_enable``, non-reentrant; TuneDeck's ``--checkpointing standard``) and without (stock
without it; TuneDeck's default, whose start says what it chose).
Tokens/s counts the real (unpadded) tokens of the steps after ``--warmup``; the peak is the allocator's reserved
peak over the steps (the CUDA context excluded).

    python benchmarks/vision_h200.py --out benchmarks/vision_h200.json          # on the GPU machine (minutes)
    python benchmarks/vision_h200.py --shape tiny --device cpu --steps 3 --warmup 1 --out /tmp/vision_smoke.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": {
        "text": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, max_position_embeddings=32768, vocab_size=151936,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       fullatt_block_indexes=[7, 15, 23, 31], window_size=112),
        "pixels": 448 * 448,
    },
    "tiny": {
        "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, vocab_size=512,
                     rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        "vision": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                       fullatt_block_indexes=[0]),
        "pixels": 56 * 56,
    },
}  # fmt: skip
LANGUAGE_LINEAR = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def build_folder(folder: Path, shape: str, device: str) -> None:
    """The model (random weights, bf16) and its processor files, as a local model folder."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from vision_models import QWEN_TEMPLATE, tokenizer_with

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tokenizer = tokenizer_with([*specials, "<|video_pad|>"], eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in [*specials, "<|video_pad|>"]}
    spec = SHAPES[shape]
    config = Qwen2_5_VLConfig(
        text_config=spec["text"], vision_config=spec["vision"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model  # the sides run in their own processes: this one holds no GPU memory while they do
    if device != "cpu":
        torch.cuda.empty_cache()
    tokenizer.save_pretrained(folder)
    image_processor_class()(size={"shortest_edge": 56 * 56, "longest_edge": spec["pixels"]}).save_pretrained(folder)


def image_processor_class() -> Any:
    """Qwen-VL's image processor that needs no torchvision (named ...Pil from transformers 5.2x)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    return Qwen2VLImageProcessorPil


def write_data(folder: Path, count: int, pixels: int) -> Path:
    from PIL import Image, ImageDraw

    side = int(pixels**0.5)
    rng = random.Random(0)
    rows = []
    for i in range(count):
        image = Image.new("RGB", (side, side), (255, 255, 255))
        colour = tuple(rng.randrange(256) for _ in range(3))
        ImageDraw.Draw(image).rectangle((side // 4, side // 4, 3 * side // 4, 3 * side // 4), fill=colour)
        image.save(folder / f"{i}.png")
        user = [{"type": "image", "image": f"{i}.png"}, {"type": "text", "text": "what colour is the square?"}]
        answer = f"the square is rgb {colour[0]} {colour[1]} {colour[2]}, drawn on white."
        rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def peak_bytes(device: str) -> int:
    import torch

    if device == "cpu":
        import psutil

        return int(psutil.Process().memory_info().rss)
    return int(torch.cuda.max_memory_reserved())


def allocated_peak(device: str) -> int | None:
    """The allocator's peak in live tensors since its last reset (TuneDeck resets it every step), on a GPU."""
    import torch

    return None if device == "cpu" else int(torch.cuda.max_memory_allocated())


def longest_example(folder: Path, data: Path, pixels: int) -> int:
    """The longest example in tokens, image tokens included (the examples differ only in their answers' digits)."""
    from engine.config import ModelConfig
    from engine.vision.data import load_vision_examples
    from engine.vision.encode import encode
    from engine.vision.model import load_processor

    processor = load_processor(ModelConfig(name=str(folder)))
    return max(len(encode(processor, example, pixels)) for example in load_vision_examples(data))


def run_tunedeck(folder: Path, data: Path, args: argparse.Namespace, recompute: str, work: Path) -> dict[str, Any]:
    """``tunedeck train --json`` on the folder and data in a fresh process (the user's environment, no allocator
    setting exported), in micro-batches of exactly ``--batch`` padded rows as on the stock side."""
    from engine.bench.trl_sides import run_tunedeck as run_cli

    longest = longest_example(folder, data, SHAPES[args.shape]["pixels"])
    command = [
        sys.executable, "-m", "app", "train", "--model", str(folder), "--data", str(data), "--dtype", "bfloat16",
        "--eval-fraction", "0", "--tokens-per-batch", str(args.batch * longest), "--max-seq-len", str(longest),
        "--lora-rank", "16", "--lora-alpha", "32", "--max-steps", str(args.steps), "--device", args.device,
        "--save-every", "0", "--lr", "1e-4", "--checkpointing", "standard" if recompute == "on" else "auto",
        "--output", str(work / "runs"), "--name", f"tunedeck-{recompute}", "--json",
    ]  # fmt: skip
    log = work / f"tunedeck-{recompute}.log"
    outcome = run_cli(command, log, cuda=args.device != "cpu")["outcome"]
    if outcome != "RunFinished":
        raise SystemExit(f"TuneDeck run ended with {outcome}: see {log} and {log.with_suffix('.err')}")
    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "StepMetrics"]
    notices = [e["message"] for e in events if e["kind"] == "Notice"]
    timed = steps[args.warmup :]
    seconds = sum(s["step_time_s"] for s in timed)
    return {
        "tokens_per_s": sum(s["tokens"] for s in timed) / seconds,
        "peak_bytes": max(s["memory_bytes"] for s in steps),
        "losses": [round(s["loss"], 4) for s in steps],
        "speed_notice": next((n for n in notices if n.startswith("speed:")), ""),
        "memory_plan_notice": next((n for n in notices if n.startswith("memory plan:")), ""),
    }


def run_stock(folder: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from engine.config import ModelConfig
    from engine.vision.model import load_processor  # AutoProcessor where torchvision is installed

    processor = load_processor(ModelConfig(name=str(folder)))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16).to(args.device)
    if args.recompute == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LANGUAGE_LINEAR))
    model.train()  # from_pretrained gives eval mode, where transformers skips the recompute
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    if args.device != "cpu":
        torch.cuda.reset_peak_memory_stats()  # the steps' peak, as TuneDeck reports it, not the loading's
    seconds = tokens = 0.0
    losses = []
    for step in range(args.steps):
        chosen = [rows[(step * args.batch + i) % len(rows)] for i in range(args.batch)]
        texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in chosen]
        images = [[Image.open(data.parent / r["messages"][0]["content"][0]["image"]).convert("RGB")] for r in chosen]
        if args.device != "cpu":
            torch.cuda.synchronize()
        began = time.perf_counter()
        batch = processor(text=texts, images=images, padding=True, return_tensors="pt").to(args.device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        labels = labels.masked_fill(labels == processor.image_token_id, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.device != "cpu":
            torch.cuda.synchronize()
        losses.append(round(float(loss.detach()), 4))
        if step >= args.warmup:
            seconds += time.perf_counter() - began
            tokens += float(batch["attention_mask"].sum())
    return {
        "tokens_per_s": tokens / seconds,
        "peak_bytes": peak_bytes(args.device),
        "allocated_peak_bytes": allocated_peak(args.device),
        "losses": losses,
    }


def child(args: argparse.Namespace) -> None:
    Path(args.out).write_text(json.dumps(run_stock(Path(args.folder), Path(args.data), args)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="padded rows a micro-batch")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    parser.add_argument("--recompute", choices=["on", "off", "both"], default="both")
    parser.add_argument("--side", choices=["stock"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    (work / "model").mkdir()
    build_folder(work / "model", args.shape, args.device)
    data = write_data(work, args.examples, SHAPES[args.shape]["pixels"])
    results: dict[str, dict[str, Any]] = {}
    for recompute in ["on", "off"] if args.recompute == "both" else [args.recompute]:
        results[recompute] = {}
        out = work / f"stock-{recompute}.json"
        common = ["--shape", args.shape, "--device", args.device, "--steps", str(args.steps)]
        common += ["--warmup", str(args.warmup), "--batch", str(args.batch), "--recompute", recompute]
        command = [sys.executable, __file__, "--side", "stock", "--folder", str(work / "model"), "--data", str(data)]
        subprocess.run([*command, *common, "--out", str(out)], check=True)
        results[recompute]["stock"] = json.loads(out.read_text())
        results[recompute]["tunedeck"] = run_tunedeck(work / "model", data, args, recompute, work)
    write_results(args, results)


def write_results(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    from engine.bench import gpu_environment, write_report

    about = gpu_environment(("torch", "transformers", "peft"))
    ratios = {
        recompute: {
            "tokens_per_s": round(pair["tunedeck"]["tokens_per_s"] / pair["stock"]["tokens_per_s"], 3),
            "peak_memory": round(pair["tunedeck"]["peak_bytes"] / pair["stock"]["peak_bytes"], 3),
        }
        for recompute, pair in results.items()
    }
    record = {
        **about, "tunedeck_vs_stock": ratios, "shape": args.shape, "device": args.device, "steps": args.steps,
        "warmup": args.warmup, "batch": args.batch, "lora": "r16 on the language model's linear layers, vision frozen",
        "recompute": "on: non-reentrant, both sides; off: stock without, TuneDeck automatic (see speed_notice)",
        **{f"recompute_{recompute}": pair for recompute, pair in results.items()},
        "command": " ".join(["python", "benchmarks/vision_h200.py", *sys.argv[1:]]),
    }  # fmt: skip
    lines = [
        f"# Vision-language training, {args.shape}, {about['gpu']}\n",
        f"`{record['command']}`\n",
        f"{about['versions']}, {about['date']}; "
        f"micro-batches of {args.batch} padded rows, {args.steps} steps, the first {args.warmup} untimed.\n",
        "| recompute | side | tokens/s | peak memory (GiB) |",
        "|---|---|---:|---:|",
    ]
    for recompute, pair in results.items():
        for side in ("stock", "tunedeck"):
            lines.append(
                f"| {recompute} | {side} | {pair[side]['tokens_per_s']:.0f} | {pair[side]['peak_bytes'] / 2**30:.2f} |"
            )
        ratio = ratios[recompute]
        lines.append(f"| {recompute} | TuneDeck / stock | {ratio['tokens_per_s']:.2f}x | {ratio['peak_memory']:.2f}x |")
    notices = [f"- TuneDeck, recompute {r}: {pair['tunedeck']['speed_notice']}" for r, pair in results.items()]
    lines += ["", *notices]
    write_report(record, Path(args.out), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
