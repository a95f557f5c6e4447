"""Chat with a run's adapter: streamed pieces, a stop that ends generation early, base vs tuned on one model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers import write_jsonl

from engine.config import RunConfig
from engine.errors import TuneDeckError
from engine.model.chat import GenerationSettings, load_chat_model, prompt_ids, reply, stream_reply
from engine.train import run

PROMPT = [{"role": "user", "content": "say 3"}]
GREEDY = GenerationSettings(temperature=0, max_new_tokens=40)


def train_tiny_run(model_dir: Path, root: Path, steps: int = 4) -> Path:
    """A finished run folder of the tiny model, trained hard enough for the adapter to change its answers."""
    rows = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"number {i}"}]}
        for i in range(24)
    ]
    data = write_jsonl(root / "chat.jsonl", rows)
    config = RunConfig.from_dict(
        {
            "model": {"name": str(model_dir)},
            "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": 128, "eval_fraction": 0.1},
            "training": {"max_steps": steps, "learning_rate": 5e-3, "warmup_steps": 1},
            "output": {"dir": str(root / "runs"), "name": "run"},
        }
    )
    events = list(run(config))
    assert type(events[-1]).__name__ == "RunFinished", events[-1]
    return Path(events[-1].run_dir)


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat(run_folder: Path):
    return load_chat_model(run_folder, device="cpu")


def test_prompt_uses_the_chat_template(chat) -> None:
    text = chat.tokenizer.decode(prompt_ids(chat, PROMPT)[0])
    assert text == "<|im_start|>user\nsay 3<|im_end|>\n<|im_start|>assistant\n"


def test_reply_streams_in_pieces_that_add_up_to_generate(chat) -> None:
    pieces = list(stream_reply(chat, PROMPT, GREEDY))
    assert len(pieces) > 1
    ids = prompt_ids(chat, PROMPT)
    out = chat.model.generate(input_ids=ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert "".join(pieces) == chat.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_stop_ends_the_reply_early(chat) -> None:
    full = list(stream_reply(chat, PROMPT, GREEDY))
    stop = threading.Event()
    stopped = []
    for piece in stream_reply(chat, PROMPT, GREEDY, stop=stop):
        stopped.append(piece)
        stop.set()
    assert 1 <= len(stopped) < len(full) // 2
    assert "".join(full).startswith("".join(stopped))


def test_reader_leaving_early_does_not_leave_generation_running(chat) -> None:
    pieces = stream_reply(chat, PROMPT, GenerationSettings(temperature=0, max_new_tokens=2000))
    next(pieces)
    pieces.close()
    assert not [t for t in threading.enumerate() if t.name == "tunedeck-generate"]


def test_base_and_tuned_answer_differently_from_one_model(chat, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tuned = reply(chat, PROMPT, GREEDY)
    base = reply(chat, PROMPT, GREEDY, use_adapter=False)
    assert tuned != base
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = prompt_ids(chat, PROMPT)
    out = plain.generate(input_ids=ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert base == chat.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert reply(chat, PROMPT, GREEDY) == tuned  # the adapter is back on after the base reply


def test_sampling_settings_are_used_and_seeded(chat) -> None:
    hot = GenerationSettings(temperature=1.5, top_p=1.0, max_new_tokens=20, seed=1)
    assert reply(chat, PROMPT, hot) == reply(chat, PROMPT, hot)
    other = GenerationSettings(temperature=1.5, top_p=1.0, max_new_tokens=20, seed=2)
    assert reply(chat, PROMPT, hot) != reply(chat, PROMPT, other)


def test_bad_settings_and_unfinished_runs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TuneDeckError, match="top-p"):
        GenerationSettings(top_p=0)
    with pytest.raises(TuneDeckError, match="no finished adapter"):
        load_chat_model(tmp_path)


def test_demo_model_adapter_chats_on_cpu(tmp_path: Path) -> None:
    """A run folder on the built-in demo model (its adapter freshly initialised) loads and answers."""
    import torch

    from engine.config import LoraConfig, ModelConfig
    from engine.model.load import add_lora, load_base_model, load_tokenizer
    from engine.run.folder import save_adapter

    config = RunConfig.from_dict({"model": {"name": "demo"}})
    config.save(tmp_path / "config.json")
    model = add_lora(load_base_model(ModelConfig(), torch.device("cpu"), torch.float32), LoraConfig(), qlora=False)
    save_adapter(model, load_tokenizer(ModelConfig()), tmp_path / "adapter")
    demo = load_chat_model(tmp_path, device="cpu")
    prompt = [{"role": "user", "content": "Convert 12 March 2021 to ISO format."}]
    pieces = list(stream_reply(demo, prompt, GenerationSettings(temperature=0, max_new_tokens=12)))
    assert pieces and "".join(pieces).strip()
    # A fresh LoRA adapter is zero: tuned and base must agree exactly.
    assert "".join(pieces) == reply(
        demo, prompt, GenerationSettings(temperature=0, max_new_tokens=12), use_adapter=False
    )


def test_chat_command_answers_a_prompt_as_tuned_and_base(run_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli.runs import chat_main

    code = chat_main([str(run_folder), "--prompt", "say 3", "--base", "--temperature", "0", "--max-tokens", "40"])
    assert code == 0
    out = capsys.readouterr().out
    chat = load_chat_model(run_folder, device="cpu")
    assert f"tuned> {reply(chat, PROMPT, GREEDY)}\n" in out
    assert f"base>  {reply(chat, PROMPT, GREEDY, use_adapter=False)}\n" in out


def test_interactive_chat_keeps_the_conversation(
    run_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli.runs import chat_main

    typed = iter(["say 3", "say 4", ""])
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    assert chat_main([str(run_folder), "--temperature", "0", "--max-tokens", "10", "--device", "cpu"]) == 0
    chat = load_chat_model(run_folder, device="cpu")
    first = reply(chat, PROMPT, GenerationSettings(temperature=0, max_new_tokens=10))
    history = [*PROMPT, {"role": "assistant", "content": first}, {"role": "user", "content": "say 4"}]
    second = reply(chat, history, GenerationSettings(temperature=0, max_new_tokens=10))
    assert capsys.readouterr().out == f"tuned> {first}\ntuned> {second}\n"
