"""Talking to a fine-tuned model: a run's adapter on its base model, streamed token by token, stoppable.

The point of chatting after a run is to see what the fine-tune changed, so the same loaded model answers both
as the tuned model and as the base model: peft's ``disable_adapter()`` switches the LoRA layers off for one
generation, which costs no second copy of the weights. ``model.generate`` runs in a thread that feeds a
``TextIteratorStreamer``; the caller reads text pieces as they come and can stop a reply between two tokens with
a ``threading.Event`` that a stopping criterion checks. Nothing here imports Qt: the app's worker and
``tunedeck chat`` both iterate ``stream_reply``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig
from engine.errors import TuneDeckError
from engine.model.adapter import LAST_ADAPTER, RunAdapter, run_adapter

ADAPTER_DIR = LAST_ADAPTER


@dataclass(frozen=True)
class GenerationSettings:
    """How replies are sampled. A temperature of 0 means greedy decoding (the same reply every time)."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 256
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise TuneDeckError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TuneDeckError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise TuneDeckError(f"max tokens must be at least 1, got {self.max_new_tokens}")


@dataclass
class ChatModel:
    """A base model with a run's adapter loaded on it (``has_adapter`` False when chatting with a bare model)."""

    model: Any
    tokenizer: Any
    label: str
    has_adapter: bool
    device: torch.device
    adapter: RunAdapter | None = None
    """Which of the run's adapters is loaded (the best by default); None for a bare model."""


def adapter_dir(run_folder: str | Path) -> Path:
    return Path(run_folder) / ADAPTER_DIR


def load_chat_model(run_folder: str | Path, device: str = "auto", adapter: str = "best") -> ChatModel:
    """The run's base model (from its config.json) with the run's ``adapter`` loaded, ready to generate: ``best``
    (the lowest held-out loss; the last where the run kept none) or ``last``."""
    from peft import PeftModel

    folder = Path(run_folder)
    chosen = run_adapter(folder, adapter)
    if chosen is None:
        raise TuneDeckError(
            f"{folder} has no finished adapter ({ADAPTER_DIR}/adapter_config.json)",
            hint="a run writes its adapter when it finishes or is stopped; resume it to get one",
        )
    config = RunConfig.load(folder / "config.json")
    base, tokenizer, torch_device = _load_base(config, device, tokenizer_folder=chosen.folder)
    model = PeftModel.from_pretrained(base, str(chosen.folder))
    model.eval()
    return ChatModel(model, tokenizer, folder.name, True, torch_device, chosen)


def load_base_chat_model(model_name: str, device: str = "auto") -> ChatModel:
    """A bare model ('demo', a folder or a hub id) to chat with, without any adapter."""
    config = RunConfig.from_dict({"model": {"name": model_name}})
    base, tokenizer, torch_device = _load_base(config, device, tokenizer_folder=None)
    base.eval()
    return ChatModel(base, tokenizer, model_name, False, torch_device)


def _load_base(config: RunConfig, device: str, tokenizer_folder: Path | None) -> tuple[Any, Any, torch.device]:
    from engine.data.tokenize import ensure_chat_template
    from engine.model.load import load_base_model, load_tokenizer, pick_device, pick_dtype

    torch_device = pick_device(device)
    # QLoRA adapters were trained on the 4-bit base; on a CPU-only machine the plain base is the faithful choice.
    model_config = config.model if torch_device.type == "cuda" else dataclasses.replace(config.model, qlora=False)
    if tokenizer_folder is not None and (tokenizer_folder / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    else:
        tokenizer = load_tokenizer(model_config)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    ensure_chat_template(tokenizer)  # the same ChatML fallback the run trained with
    base: Any = load_base_model(model_config, torch_device, pick_dtype(model_config.dtype, torch_device))
    base.config.use_cache = True  # training turned the KV cache off; generation wants it
    return base, tokenizer, torch_device


def prompt_ids(chat: ChatModel, messages: Sequence[dict[str, str]]) -> torch.Tensor:
    """The conversation rendered with the model's chat template, ending where the assistant speaks next."""
    text = chat.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    ids: torch.Tensor = chat.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids.to(chat.device)


class StopFlag:
    """A stopping criterion that ends generation once any of ``events`` is set (checked after every token)."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        stopped = any(event.is_set() for event in self.events)
        return torch.full((input_ids.shape[0],), stopped, dtype=torch.bool, device=input_ids.device)


def _generate_kwargs(
    chat: ChatModel, ids: torch.Tensor, settings: GenerationSettings, stop: StopFlag
) -> dict[str, Any]:
    from transformers import StoppingCriteriaList

    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": settings.max_new_tokens,
        "stopping_criteria": StoppingCriteriaList([stop]),
        "pad_token_id": chat.tokenizer.pad_token_id,
        "eos_token_id": chat.tokenizer.eos_token_id,
    }
    if settings.temperature > 0:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kwargs


def stream_reply(
    chat: ChatModel,
    messages: Sequence[dict[str, str]],
    settings: GenerationSettings = GenerationSettings(),
    *,
    use_adapter: bool = True,
    stop: threading.Event | None = None,
) -> Iterator[str]:
    """Yield the assistant's reply piece by piece; ``use_adapter=False`` answers as the base model."""
    from transformers import TextIteratorStreamer

    abandoned = threading.Event()  # set when the reader stops early; the caller's ``stop`` stays theirs
    streamer = TextIteratorStreamer(chat.tokenizer, skip_prompt=True, skip_special_tokens=True)
    flag = StopFlag(abandoned, stop) if stop is not None else StopFlag(abandoned)
    kwargs = _generate_kwargs(chat, prompt_ids(chat, messages), settings, flag)
    failure: list[BaseException] = []

    def generate() -> None:
        try:
            if settings.seed is not None:
                torch.manual_seed(settings.seed)
            switch = chat.model.disable_adapter() if chat.has_adapter and not use_adapter else contextlib.nullcontext()
            with torch.inference_mode(), switch:
                chat.model.generate(**kwargs, streamer=streamer)
        except BaseException as err:  # re-raised in the reading thread
            failure.append(err)
            streamer.end()

    thread = threading.Thread(target=generate, name="tunedeck-generate", daemon=True)
    thread.start()
    try:
        yield from streamer
    finally:
        abandoned.set()  # a reader that gives up early must not leave generation running
        thread.join()
    if failure:
        raise TuneDeckError(f"generation failed: {type(failure[0]).__name__}: {failure[0]}") from failure[0]


def reply(
    chat: ChatModel,
    messages: Sequence[dict[str, str]],
    settings: GenerationSettings = GenerationSettings(),
    *,
    use_adapter: bool = True,
) -> str:
    """The whole reply at once (tests, scripts)."""
    return "".join(stream_reply(chat, messages, settings, use_adapter=use_adapter))
