"""The best adapter by held-out loss is kept beside the last, a rising held-out loss is reported, early stopping
ends a run when asked, and chat and exports take the best adapter unless told otherwise.

The runs train a tiny Llama whose weights are initialised large enough for LoRA to fit its training answers within
a few steps at a high learning rate; the held-out rows ask the same prompts for another answer, so the held-out
loss falls while the shared tokens are learned and then rises as the training answers are memorised.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_model, build_tokenizer, write_jsonl
from safetensors.torch import load_file

from engine.config import RunConfig
from engine.errors import ConfigError, TuneDeckError
from engine.events import BestAdapterKept, EvalMetrics, EvalRising, Notice, RunFailed, RunFinished
from engine.export import export_adapter
from engine.model.adapter import run_adapter
from engine.model.chat import load_chat_model
from engine.run.best import RISES_TO_WARN, EvalWatch
from engine.run.control import RunControl
from engine.train import run

STEPS = 12


@pytest.fixture(scope="module")
def fitting_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fitting-llama")
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(folder, vocab, initializer_range=0.3)
    return folder


def chats(path: Path, answer: str) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": answer}]}
        for i in range(8)
    ]
    return write_jsonl(path, rows)


def config(model: Path, folder: Path, **training: Any) -> RunConfig:
    train = chats(folder / "train.jsonl", "number one")
    held_out = chats(folder / "held-out.jsonl", "number two")
    data = {"path": str(train), "eval_path": str(held_out), "max_seq_len": 32, "tokens_per_batch": 64}
    settings = {"max_steps": STEPS, "learning_rate": 2e-2, "warmup_steps": 0, "schedule": "constant", "early_stop": 0}
    return RunConfig.from_dict(
        {
            "model": {"name": str(model)},
            "data": {**data, **training.pop("data", {})},
            "lora": {"rank": 4, "alpha": 32.0},
            "training": {**settings, "eval_every": 2, "save_every": 2, **training},
            "output": {"dir": str(folder / "runs"), "name": "run", "keep_checkpoints": STEPS},
        }
    )


def finished(events: list[Any]) -> RunFinished:
    failed = [e for e in events if isinstance(e, RunFailed)]
    assert not failed, failed
    assert isinstance(events[-1], RunFinished)
    return events[-1]


def eval_losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def overfit(fitting_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    events = list(run(config(fitting_model, tmp_path_factory.mktemp("overfit"))))
    return events, Path(finished(events).run_dir)


def test_the_best_adapter_is_the_one_of_the_lowest_held_out_loss(overfit: tuple[list[Any], Path]) -> None:
    events, run_dir = overfit
    losses = eval_losses(run_dir)
    best_step, best_loss = min(losses, key=lambda item: item[1])
    assert losses[0][0] < best_step < losses[-1][0], losses  # the held-out loss fell, then rose again
    done = finished(events)
    assert (done.best_step, done.best_eval_loss) == (best_step, best_loss) and not done.stopped_early
    assert done.best_adapter_dir == str(run_dir / "adapter-best")
    assert json.loads((run_dir / "adapter-best" / "best.json").read_text()) == {
        "step": best_step,
        "eval_loss": best_loss,
    }
    kept = [e.step for e in events if isinstance(e, BestAdapterKept)]
    assert kept[-1] == best_step and kept == sorted(kept)
    # the kept weights are the model's at that step (its checkpoint), not the weights the run ended with
    best = load_file(run_dir / "adapter-best" / "adapter_model.safetensors")
    at_best = load_file(run_dir / "checkpoints" / f"step-{best_step:06d}" / "adapter.safetensors")
    last = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert same_weights(best, at_best) and not same_weights(best, last)


def test_a_rising_held_out_loss_is_reported_once_a_streak(overfit: tuple[list[Any], Path]) -> None:
    events, run_dir = overfit
    losses = dict(eval_losses(run_dir))
    steps = sorted(losses)
    rising = [e for e in events if isinstance(e, EvalRising)]
    assert rising, losses
    for warning in rising:
        earlier = [s for s in steps if s <= warning.step][-RISES_TO_WARN - 1 :]
        assert all(losses[a] < losses[b] for a, b in itertools.pairwise(earlier)), (warning, losses)
        assert warning.rises == RISES_TO_WARN and f"step {warning.best_step}" in warning.message
        assert warning.best_eval_loss == min(losses[s] for s in steps if s <= warning.step)


def test_early_stopping_ends_the_run_after_evaluations_without_a_new_best(
    fitting_model: Path, overfit: tuple[list[Any], Path], tmp_path: Path
) -> None:
    whole = dict(eval_losses(overfit[1]))
    best_step = min(whole, key=whole.__getitem__)
    events = list(run(config(fitting_model, tmp_path, early_stop=2)))
    done = finished(events)
    assert done.stopped_early and not done.cancelled
    assert done.step == best_step + 2 * 2 < STEPS and done.best_step == best_step  # two evaluations, 2 steps apart
    assert [e.step for e in events if isinstance(e, EvalMetrics)][-1] == done.step  # not evaluated twice
    assert any(isinstance(e, Notice) and e.message.startswith("stopping early") for e in events)
    assert (Path(done.run_dir) / "adapter" / "adapter_config.json").exists()


def test_early_stopping_is_refused_without_held_out_data(fitting_model: Path, tmp_path: Path) -> None:
    events = list(run(config(fitting_model, tmp_path, early_stop=2, data={"eval_path": None, "eval_fraction": 0.0})))
    failed = events[-1]
    assert isinstance(failed, RunFailed) and "held-out" in failed.message and "--eval-fraction" in str(failed.hint)
    with pytest.raises(ConfigError, match="eval_every is 0"):
        config(fitting_model, tmp_path, early_stop=2, eval_every=0)


def test_a_resumed_run_keeps_its_best_and_its_rises(
    fitting_model: Path, overfit: tuple[list[Any], Path], tmp_path: Path
) -> None:
    control = RunControl()
    first = []
    for event in run(config(fitting_model, tmp_path), control=control):
        first.append(event)
        if isinstance(event, EvalMetrics) and event.step == 6:
            control.stop()
    assert finished(first).cancelled
    resumed = list(run(RunConfig(), resume=Path(finished(first).run_dir)))
    whole = finished(overfit[0])
    assert (finished(resumed).best_step, finished(resumed).best_eval_loss) == (whole.best_step, whole.best_eval_loss)
    rising = [e.step for e in overfit[0] if isinstance(e, EvalRising)]
    assert [e.step for e in first + resumed if isinstance(e, EvalRising)] == rising


def test_chat_and_exports_take_the_best_adapter_unless_asked_for_the_last(
    overfit: tuple[list[Any], Path], tmp_path: Path
) -> None:
    _, run_dir = overfit
    best, last = run_adapter(run_dir), run_adapter(run_dir, "last")
    assert best is not None and best.which == "best" and best.folder == run_dir / "adapter-best"
    assert last is not None and last.folder == run_dir / "adapter"
    exported = export_adapter(run_dir, tmp_path / "best")
    weights = load_file(exported / "adapter_model.safetensors")
    assert same_weights(weights, load_file(best.folder / "adapter_model.safetensors"))
    assert f"step {best.step}" in (exported / "README.md").read_text()
    exported_last = export_adapter(run_dir, tmp_path / "last", adapter="last")
    assert same_weights(
        load_file(exported_last / "adapter_model.safetensors"), load_file(last.folder / "adapter_model.safetensors")
    )
    chat = load_chat_model(run_dir, device="cpu")
    assert chat.adapter == best
    assert load_chat_model(run_dir, device="cpu", adapter="last").adapter == last


def test_a_run_without_held_out_data_offers_its_last_adapter(fitting_model: Path, tmp_path: Path) -> None:
    events = list(run(config(fitting_model, tmp_path, max_steps=2, data={"eval_path": None, "eval_fraction": 0.0})))
    done = finished(events)
    assert done.best_adapter_dir is None and not (Path(done.run_dir) / "adapter-best").exists()
    chosen = run_adapter(done.run_dir)
    assert chosen is not None and chosen.which == "last" and chosen.describe() == "the last adapter"


@pytest.mark.parametrize(
    ("losses", "early_stop", "best", "warned_at", "stopped_at"),
    [
        ([3.0, 2.0, 2.5, 2.6, 2.7, 2.8], 0, 2, [5], None),  # three rises after the best: said once
        ([3.0, 2.0, 2.5, 2.4, 2.6, 2.7], 0, 2, [], None),  # a fall breaks the streak
        ([3.0, 2.0, 2.5, 2.4, 2.6, 2.7], 3, 2, [], 5),  # no new best for three evaluations: stop
        ([3.0, 2.0, 2.0, 1.9], 2, 4, [], None),  # an equal loss is no new best, a lower one is
    ],
)
def test_the_watch_reads_a_series_of_held_out_losses(
    losses: list[float], early_stop: int, best: int, warned_at: list[int], stopped_at: int | None
) -> None:
    watch = EvalWatch(early_stop)
    verdicts = [watch.observe(step, loss) for step, loss in enumerate(losses, start=1)]
    assert [step for step, v in enumerate(verdicts, start=1) if v.warn] == warned_at
    assert next((step for step, v in enumerate(verdicts, start=1) if v.stop), None) == stopped_at
    assert watch.best_step == best


def test_a_dpo_run_keeps_the_adapter_of_its_lowest_held_out_pair_loss(fitting_model: Path, tmp_path: Path) -> None:
    def pairs(path: Path, chosen: str, rejected: str) -> Path:
        return write_jsonl(path, [{"prompt": f"say {i}: ", "chosen": chosen, "rejected": rejected} for i in range(6)])

    train = pairs(tmp_path / "pairs.jsonl", "number one", "the fox")
    held_out = pairs(tmp_path / "held-out-pairs.jsonl", "the fox", "number one")  # the opposite preference
    settings = config(
        fitting_model, tmp_path, method="dpo", max_steps=6, eval_every=1, save_every=1, learning_rate=5e-3
    )
    data = {"path": str(train), "eval_path": str(held_out)}
    events = list(run(RunConfig.from_dict({**settings.to_dict(), "data": {**settings.to_dict()["data"], **data}})))
    done, run_dir = finished(events), Path(finished(events).run_dir)
    records = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert all("reward_accuracy" in r for r in records)  # the held-out pairs' loss is what was watched
    best = min(records, key=lambda r: r["eval_loss"])
    assert (done.best_step, done.best_eval_loss) == (best["step"], best["eval_loss"])
    assert records[-1]["eval_loss"] > best["eval_loss"]
    at_best = load_file(run_dir / "checkpoints" / f"step-{best['step']:06d}" / "adapter.safetensors")
    assert same_weights(load_file(run_dir / "adapter-best" / "adapter_model.safetensors"), at_best)


def test_the_command_line_warns_names_the_best_adapter_and_exports_the_last_when_asked(
    overfit: tuple[list[Any], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from engine.cli.progress import ProgressPrinter
    from engine.cli.runs import export_main

    events, run_dir = overfit
    stream = io.StringIO()
    printer = ProgressPrinter(stream)
    for event in events:
        printer.handle(event)
    rising = next(e for e in events if isinstance(e, EvalRising))
    assert f"warning: step {rising.step}: the held-out loss has risen 3 evaluations in a row" in stream.getvalue()
    assert (
        f"best adapter (lowest eval loss, {rising.best_eval_loss:.4f} at step {rising.best_step}" in printer.summary()
    )
    assert export_main([str(run_dir), "--to", str(tmp_path / "last"), "--last"]) == 0
    assert "; its weights are the last adapter" in capsys.readouterr().out
    last = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert same_weights(load_file(tmp_path / "last" / "adapter_model.safetensors"), last)


def test_a_resumed_watch_replays_the_logged_evaluations(tmp_path: Path) -> None:
    stopped = EvalWatch.resumed(2, [(2, 3.0), (4, 2.0), (6, 2.5), (8, 2.6)], tmp_path)
    assert stopped.stopping and (stopped.best_step, stopped.best_loss, stopped.rises) == (4, 2.0, 2)
    going = EvalWatch.resumed(3, [(2, 3.0), (4, 2.0), (6, 2.5), (8, 2.6)], tmp_path)
    assert not going.stopping and going.observe(10, 2.7).warn  # the third rise in a row, counted across the resume


def test_a_new_run_from_a_run_starts_from_its_best_adapter_unless_asked_for_the_last(
    overfit: tuple[list[Any], Path], tmp_path: Path
) -> None:
    from engine.cli.train import train_config, train_parser

    _, run_dir = overfit
    data = chats(tmp_path / "more.jsonl", "number three")

    def parsed(*extra: str) -> RunConfig:
        args = train_parser().parse_args(["--data", str(data), "--adapter", str(run_dir), *extra])
        return train_config(args)

    assert parsed().model.adapter == str(run_dir / "adapter-best")  # as chat and export take it
    assert parsed("--last").model.adapter == str(run_dir / "adapter")
    plain = run_dir / "adapter"  # a PEFT folder is taken as it is
    args = train_parser().parse_args(["--data", str(data), "--adapter", str(plain)])
    assert train_config(args).model.adapter == str(plain)
    with pytest.raises(TuneDeckError, match="--last"):
        train_config(train_parser().parse_args(["--data", str(data), "--last"]))
    # the run starts from the best adapter's weights: its first held-out loss is the best step's
    best_loss = json.loads((run_dir / "adapter-best" / "best.json").read_text())["eval_loss"]
    model = json.loads((run_dir / "config.json").read_text())["model"]["name"]
    start = RunConfig.from_dict(
        {
            "model": {"name": model, "adapter": str(run_dir)},
            "data": {"path": str(chats(tmp_path / "t.jsonl", "number one")),
                     "eval_path": str(chats(tmp_path / "h.jsonl", "number two")),
                     "max_seq_len": 32, "tokens_per_batch": 64},
            "lora": {"rank": 4, "alpha": 32.0},
            "training": {"max_steps": 1, "learning_rate": 1e-9, "warmup_steps": 0, "eval_every": 1, "early_stop": 0,
                         "keep_knowledge": False},
            "output": {"dir": str(tmp_path / "runs"), "name": "from-best"},
        }
    )  # fmt: skip
    first = next(e for e in run(start) if isinstance(e, EvalMetrics))
    assert first.loss == pytest.approx(best_loss, abs=1e-3)
