"""Step graphs: rows padded into shape buckets train exactly as they are, and replayed micro-steps train as eager ones.

A real CUDA graph needs a GPU (tests/test_speed_gpu.py); here a stand-in "graph" records the captured function and
runs it again on every replay, so everything around the capture is exercised on the CPU: buckets, padding,
static inputs refilled per micro-batch, gradients bound to fixed tensors, fallback on a failed capture.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from speed_models import VOCAB, grads, max_relative_error, packed_batch, tiny_lora_model

from engine.config import SpeedConfig
from engine.data.packing import IGNORE_INDEX
from engine.speed import SpeedController, step_graphs, warm_up
from engine.speed.fused_loss import linear_cross_entropy
from engine.speed.offloaded_checkpoint import ActivationOffloader
from engine.speed.step_graphs import Bucket, StepGraphs, bucket_of, flatten, pad_to

AUTO = SpeedConfig()


class ReplayingCapture:
    """A CPU stand-in for a CUDA graph: capturing runs nothing, each replay runs the function on the captured
    inputs."""

    def __init__(self) -> None:
        self.captures = 0

    def __call__(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.captures += 1
        out = torch.zeros((), dtype=torch.float32)
        return lambda: out.copy_(function()), out


class FailingCapture:
    def __call__(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


def graphed(controller: SpeedController, capture: Any) -> None:
    """Step graphs on, as on a GPU, with ``capture`` standing in for CUDA graph capture."""
    controller.graphs.switch(True)
    controller.graphs.capturer = lambda: capture


# --- buckets and padding ----------------------------------------------------------------------------------------


def test_buckets_round_rows_documents_and_positions_up() -> None:
    batch = packed_batch((700, 600, 500))  # 1,800 tokens, 3 documents, 1,797 trained positions
    assert bucket_of(batch, longest=4096) == Bucket(tokens=2048, documents=4, positions=2048)
    assert bucket_of(batch, longest=1800) == Bucket(tokens=2048, documents=4, positions=2048)  # steps of 256
    assert bucket_of(packed_batch((4096,)), longest=4096) == Bucket(4096, 1, 4096)  # one document stays one
    assert bucket_of(packed_batch((3000, 1000)), longest=16384) == Bucket(4096, 2, 4096)  # steps of 2,048


def test_a_bucket_pads_at_most_an_eighth_of_the_longest_row() -> None:
    for tokens in range(257, 8192, 97):
        bucket = bucket_of(packed_batch((tokens,)), longest=8192)
        assert tokens <= bucket.tokens < tokens + 8192 // 8 + 128


def test_padding_extends_the_last_document_and_ignores_what_it_adds() -> None:
    batch = packed_batch((5, 3))
    padded = pad_to(batch, Bucket(tokens=12, documents=4, positions=10))
    assert padded.input_ids.shape == (1, 12) and padded.labels[0, 8:].eq(IGNORE_INDEX).all()
    assert padded.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    assert padded.document_ids[0].tolist() == [0] * 5 + [1] * 7
    assert padded.cu_seqlens.tolist() == [0, 5, 12, 12, 12] and padded.max_seqlen == 12
    assert padded.loss_positions.tolist() == [*batch.loss_positions.tolist(), *[11] * 4]
    with pytest.raises(ValueError, match="exceeds"):
        pad_to(batch, Bucket(tokens=6, documents=2, positions=8))


@pytest.mark.parametrize("metadata_cache", [True, False])
@pytest.mark.parametrize("lengths", [(37, 21, 9), (50,)])
def test_a_padded_row_gives_the_same_loss_and_gradients(metadata_cache: bool, lengths: tuple[int, ...]) -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, dataclasses.replace(AUTO, metadata_cache=metadata_cache), torch.device("cpu"))
    batch = packed_batch(lengths, seed=3)
    found = []
    for row in (batch, pad_to(batch, bucket_of(batch, longest=400))):
        model.zero_grad(set_to_none=True)
        found.append((controller.forward_backward(model, row, batch.trained_tokens), grads(model)))
    torch.testing.assert_close(found[1][0], found[0][0], rtol=1e-5, atol=0)
    assert max_relative_error(found[1][1], found[0][1]) < 1e-5


# --- inputs as graph inputs -------------------------------------------------------------------------------------


def test_flatten_keys_on_shapes_and_values_and_leaves_host_tensors_out() -> None:
    cpu = torch.device("cpu")
    tree = {"ids": torch.zeros(1, 8, dtype=torch.long), "window": None, "n": 3, "rows": [torch.ones(2)]}
    leaves, key = flatten(tree, cpu)
    assert len(leaves) == 2 and leaves[0] is tree["ids"]
    assert flatten({**tree, "ids": torch.ones(1, 8, dtype=torch.long)}, cpu)[1] == key  # new values, same key
    assert flatten({**tree, "ids": torch.zeros(1, 9, dtype=torch.long)}, cpu)[1] != key
    assert flatten({**tree, "n": 4}, cpu)[1] != key
    assert flatten({**tree, "rows": [torch.ones(2, device="meta")]}, cpu)[1] != key  # elsewhere: not an input
    assert flatten(tree, torch.device("meta")) is None  # no input on the device: nothing to replay
    assert flatten({"unknown": object()}, cpu) is None


def test_gradients_are_cleared_in_place_while_graphs_hold_them_and_freed_otherwise() -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    batch = packed_batch((30, 20))
    controller.forward_backward(model, batch, batch.trained_tokens)
    controller.zero_grad(optimizer)
    assert all(p.grad is None for p in model.parameters())  # no graphs: the memory goes back
    graphed(controller, ReplayingCapture())
    for _ in range(2):  # eager, then captured
        controller.forward_backward(model, batch, batch.trained_tokens)
    grads_before = [p.grad for p in model.parameters() if p.requires_grad]
    controller.zero_grad(optimizer)
    assert all(p.grad is g and float(g.abs().sum()) == 0 for p, g in zip(
        [p for p in model.parameters() if p.requires_grad], grads_before, strict=True))  # fmt: skip
    stray = next(p for p in model.parameters() if p.requires_grad)
    stray.grad = torch.ones_like(stray)  # not a fixed tensor: let go, so it cannot leak into the next step
    controller.zero_grad(optimizer)
    assert stray.grad is None
    controller.graphs.give_up("short of memory")
    controller.zero_grad(optimizer)
    assert all(p.grad is None for p in model.parameters())


def test_gradients_stay_bound_to_fixed_tensors_and_keep_what_they_held() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    graphs = StepGraphs(torch.device("cpu"), lambda: params)
    params[0].grad = torch.full((3,), 2.0)
    graphs._bind_grads()
    fixed = [p.grad for p in params]
    assert fixed[0].tolist() == [2.0] * 3 and fixed[1].tolist() == [0.0] * 2
    for p in params:
        p.grad = None  # what zero_grad(set_to_none=True) leaves
    fixed[0].fill_(7.0)
    graphs._bind_grads()
    assert [p.grad for p in params] == fixed and fixed[0].tolist() == [0.0] * 3


# --- replayed micro-steps ---------------------------------------------------------------------------------------

STEPS = [[(40, 30), (25, 24, 20)], [(60, 9)], [(33, 31), (70,)], [(41, 28), (30, 20, 19)], [(66,)], [(45, 23)]]
"""Micro-batches per optimizer step: buckets recur, so later micro-batches replay."""


def train(model: Any, controller: SpeedController) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for i, step in enumerate(STEPS):
        batches = [packed_batch(lengths, seed=10 * i + j) for j, lengths in enumerate(step)]
        trained = sum(b.trained_tokens for b in batches)
        losses.append(sum(float(controller.forward_backward(model, b, trained)) for b in batches))
        optimizer.step()
        controller.zero_grad(optimizer)  # as the training loop clears them
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", ["none", "offloaded"])
def test_replayed_micro_steps_train_as_eager_ones(checkpointing: str) -> None:
    settings = dataclasses.replace(AUTO, checkpointing=checkpointing)
    eager_model = tiny_lora_model("llama")
    eager = train(eager_model, SpeedController(eager_model, settings, torch.device("cpu")))
    model = tiny_lora_model("llama")
    controller = SpeedController(model, settings, torch.device("cpu"))
    capture = ReplayingCapture()
    graphed(controller, capture)
    found = train(model, controller)
    # 9 micro-batches in 4 buckets: 1, 2 and 4 (padded) documents of 128 trained positions recur; (33, 31) has 64
    assert capture.captures == controller.graphs.captured == 3
    assert controller.graphs.replays == 5  # every sighting of a bucket after its first
    fixed = controller.graphs._grads  # cleared in place between steps, never re-bound
    assert fixed and all(p.grad is g for p, g in zip(controller.graphs._params, fixed, strict=True))
    assert all(float(g.abs().sum()) == 0 for g in fixed)
    torch.testing.assert_close(torch.tensor(found[0]), torch.tensor(eager[0]), rtol=1e-5, atol=0)
    assert max_relative_error(found[1], eager[1]) < 1e-4


def test_a_failed_capture_runs_the_micro_batch_eagerly_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    eager_model = tiny_lora_model("llama")
    eager = train(eager_model, SpeedController(eager_model, AUTO, torch.device("cpu")))
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    graphed(controller, FailingCapture())
    found = train(model, controller)
    reason = controller.state()["step_graphs"]
    assert not reason["on"] and "cannot run as a CUDA graph (RuntimeError: operation not permitted" in reason["reason"]
    assert "more detail" not in reason["reason"] and controller.graphs.replays == 0
    torch.testing.assert_close(torch.tensor(found[0]), torch.tensor(eager[0]), rtol=1e-6, atol=0)
    padded = []
    monkeypatch.setattr(step_graphs, "pad_to", lambda *args: padded.append(args) or args[0])
    controller.forward_backward(model, packed_batch((40, 30)), 68)
    assert padded == []  # turned off: rows are no longer padded either
    controller.apply(AUTO)  # a new choice of switches tries again
    assert controller.graphs.failure is None


def test_a_switch_change_drops_the_graphs() -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    graphed(controller, ReplayingCapture())
    micro_batches(controller, model, 3)
    assert controller.graphs.captured == 1
    controller.apply(dataclasses.replace(AUTO, fused_loss=False))
    assert controller.graphs.captured == 0 and not controller.graphs.on  # automatic is off on the CPU


def test_graphs_are_dropped_only_after_the_gpu_has_run_their_replays() -> None:
    """Their pool's memory is unmapped when given back; a replay still queued would touch it (GPU test below)."""
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    graphed(controller, ReplayingCapture())
    held_while_waiting: list[int] = []
    controller.graphs.wait = lambda device: held_while_waiting.append(controller.graphs.captured)
    controller.apply(dataclasses.replace(AUTO, fused_loss=False))
    assert held_while_waiting == []  # nothing captured, nothing to wait for: no needless sync
    graphed(controller, ReplayingCapture())
    micro_batches(controller, model, 3)
    controller.apply(AUTO)
    assert held_while_waiting == [1]


def test_dropping_graphs_lets_cublas_give_back_the_workspaces_it_took_from_their_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cuBLAS's workspace for a capture stream lives in the graphs' pool; it goes when they go, and only then."""
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    released: list[int] = []
    monkeypatch.setattr(step_graphs, "release_cublas_workspaces", lambda device: released.append(
        controller.graphs.captured))  # fmt: skip
    controller.apply(dataclasses.replace(AUTO, fused_loss=False))
    assert released == []  # no graphs: cuBLAS keeps its workspaces
    graphed(controller, ReplayingCapture())
    micro_batches(controller, model, 3)
    controller.apply(AUTO)
    assert released == [0]  # after the graphs are gone


def test_a_failed_capture_waits_for_the_gpu_before_its_memory_and_cublas_workspaces_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failed capture's pool is unmapped after it: the GPU must have run what was queued first."""
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    order: list[str] = []
    monkeypatch.setattr(step_graphs, "release_cublas_workspaces", lambda device: order.append("release"))
    graphed(controller, FailingCapture())
    controller.graphs.wait = lambda device: order.append("wait")
    micro_batches(controller, model, 3)
    assert controller.graphs.failure is not None and order == ["wait", "release"]


def test_the_loss_divisor_may_be_a_tensor() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(1, 12, 8, requires_grad=True)
    weight = torch.randn(VOCAB, 8)
    labels = torch.randint(0, VOCAB, (1, 12))
    found = []
    for count in (9, torch.tensor(9.0)):
        hidden.grad = None
        loss = linear_cross_entropy(hidden, weight, labels, num_items=count)
        loss.backward()
        found.append((loss.detach(), hidden.grad.clone()))
    torch.testing.assert_close(found[1], found[0], rtol=1e-6, atol=0)


# --- automatic: on trial ---------------------------------------------------------------------------------------


class FakeInterval:
    """A GPU interval whose time is set by the test; ``done`` once the test says the GPU has passed it."""

    def __init__(self, ms: float) -> None:
        self.value, self.started, self.stopped, self.finished = ms, False, False, True

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def done(self) -> bool:
        return self.finished

    def ms(self) -> float:
        return self.value


def on_trial(controller: SpeedController, eager_ms: float, replay_ms: float) -> list[FakeInterval]:
    """Automatic step graphs on the CPU stand-in, their eager and replay runs timed as ``eager_ms`` and
    ``replay_ms``; the intervals handed out, in order."""
    made: list[FakeInterval] = []

    def timer() -> FakeInterval:
        made.append(FakeInterval(eager_ms if not made else replay_ms))
        return made[-1]

    controller.graphs.timer = timer
    controller.graphs.switch(True, trial=True)
    controller.graphs.capturer = lambda: ReplayingCapture()
    return made


def micro_batches(controller: SpeedController, model: torch.nn.Module, count: int) -> list[float]:
    return [float(controller.forward_backward(model, packed_batch((40, 30), seed=i), 68)) for i in range(count)]


def test_automatic_graphs_stay_where_a_replay_beats_the_eager_run() -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    made = on_trial(controller, eager_ms=420.0, replay_ms=370.0)
    micro_batches(controller, model, 4)  # compile, timed eager, capture + first replay, timed second replay
    # each timed run lasts until the next micro-batch starts: the host's work between them counts
    assert [(m.started, m.stopped) for m in made] == [(True, True), (True, False)]
    assert controller.graphs.trial is not None
    micro_batches(controller, model, 1)  # ends the timed replay and, the GPU being past it, judges
    assert [(m.started, m.stopped) for m in made] == [(True, True), (True, True)]
    assert controller.graphs.active and controller.graphs.trial is None and controller.graphs.replays == 3
    state = controller.state()["step_graphs"]
    reason = "a replayed micro-batch took 370 ms from its start to the next one's, against 420 ms run eagerly"
    assert state == {"on": True, "reason": f"automatic: on; {reason}"}


def test_automatic_graphs_go_where_the_gpu_sets_the_pace() -> None:
    model = tiny_lora_model("llama")
    eager = SpeedController(model, AUTO, torch.device("cpu"))
    reference = micro_batches(eager, model, 6)
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    on_trial(controller, eager_ms=1600.0, replay_ms=1640.0)  # the padded replay took longer
    losses = micro_batches(controller, model, 6)
    assert not controller.graphs.active and controller.graphs.captured == 0  # the pool is given back
    state = controller.state()["step_graphs"]
    assert state["on"] is False and state["reason"].startswith("automatic: off; a replayed micro-batch took 1,640 ms")
    assert "the GPU, not the host, sets the pace" in state["reason"]
    assert losses == pytest.approx(reference, rel=1e-5)  # every micro-batch trained, replayed or not


def test_a_trial_that_drops_the_graphs_waits_for_their_replays_first() -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    on_trial(controller, eager_ms=1600.0, replay_ms=1640.0)
    held_while_waiting: list[int] = []
    controller.graphs.wait = lambda device: held_while_waiting.append(controller.graphs.captured)
    micro_batches(controller, model, 5)
    assert held_while_waiting == [1] and controller.graphs.captured == 0


def test_the_trial_waits_for_the_gpu_to_pass_its_timed_replay() -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    made = on_trial(controller, eager_ms=420.0, replay_ms=100.0)
    micro_batches(controller, model, 4)
    made[1].finished = False
    micro_batches(controller, model, 2)
    assert controller.graphs.trial is not None and controller.graphs.verdict is None
    made[1].finished = True
    micro_batches(controller, model, 1)
    assert controller.graphs.trial is None and controller.graphs.verdict is not None


def test_switched_on_graphs_are_not_on_trial() -> None:
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    graphed(controller, ReplayingCapture())
    assert controller.graphs.trial is None and controller.graphs.eager_runs == step_graphs.EAGER_RUNS
    micro_batches(controller, model, 3)
    assert controller.graphs.replays == 2


# --- when it applies --------------------------------------------------------------------------------------------


def test_automatic_graphs_stay_off_where_the_row_needs_chunked_mlps_to_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_graphs, "unsupported_reason", lambda model, device: None)  # as on a GPU
    model = tiny_lora_model("llama")
    controller = SpeedController(model, dataclasses.replace(AUTO, chunked_mlp=True), torch.device("cpu"))
    assert controller.state()["step_graphs"] == {"on": False, "reason": step_graphs.MEMORY_BOUND}
    assert not controller.graphs.on
    controller.apply(AUTO)  # rows too short to chunk: graphs on trial
    assert controller.graphs.on and controller.graphs.trial is not None
    controller.apply(dataclasses.replace(AUTO, chunked_mlp=True, step_graphs=True))  # the user's choice stands
    assert controller.graphs.on and controller.graphs.trial is None


def test_automatic_graphs_go_when_a_longer_row_turns_chunking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.speed import chunked_mlp

    monkeypatch.setattr(step_graphs, "unsupported_reason", lambda model, device: None)
    resolve = chunked_mlp.resolve
    monkeypatch.setattr(chunked_mlp, "resolve", lambda requested, mode, tokens, *a, **k: (
        (True, "automatic: chunked") if tokens > 300 else resolve(requested, mode, tokens, *a, **k)))  # fmt: skip
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    on_trial(controller, eager_ms=420.0, replay_ms=100.0)
    micro_batches(controller, model, 4)
    assert controller.graphs.captured == 1
    loss = controller.forward_backward(model, packed_batch((200, 150), seed=5), 348)  # padded to 512 tokens
    assert torch.isfinite(loss) and not controller.graphs.on and controller.graphs.captured == 0
    assert controller.state()["step_graphs"] == {"on": False, "reason": step_graphs.MEMORY_BOUND}


def test_resolution() -> None:
    model, cpu, gpu = tiny_lora_model("llama"), torch.device("cpu"), torch.device("cuda")

    def resolve(requested: bool | None, model: torch.nn.Module, device: torch.device) -> tuple[bool, str]:
        return step_graphs.resolve(requested, step_graphs.unsupported_reason(model, device))

    assert resolve(None, model, gpu)[0] is True  # automatic: on trial
    assert "automatic: trying" in resolve(None, model, gpu)[1]
    assert "switched on" in resolve(True, model, gpu)[1] and resolve(True, model, gpu)[0]
    assert resolve(True, model, cpu) == (False, "CUDA graphs need an NVIDIA GPU")
    assert resolve(None, model, cpu) == (False, "automatic: off; CUDA graphs need an NVIDIA GPU")
    assert "switched off" in resolve(False, model, gpu)[1]
    dropped = tiny_lora_model("llama", dropout=0.1)
    assert "dropout" in resolve(True, dropped, gpu)[1]
    assert resolve(True, dropped, gpu)[0] is False


def test_the_offloader_forgets_copy_events_of_earlier_steps() -> None:
    offloader = ActivationOffloader(torch.device("cpu"), min_offload_bytes=0)
    offloader.stash(torch.ones(4, 3))
    offloader._buffers[0].last_read = object()  # type: ignore[assignment]
    offloader._ring[0] = (torch.ones(1), object())  # type: ignore[assignment]
    offloader.forget_events()
    assert offloader._buffers[0].last_read is None and offloader._ring == [None, None]


# --- a run ------------------------------------------------------------------------------------------------------


def run_config(model_dir: Path, data: Path, out: Path, step_graphs: bool, eval_every: int = 0) -> Any:
    from engine.config import RunConfig

    return RunConfig.from_dict({
        "model": {"name": str(model_dir)},
        "data": {"path": str(data), "max_seq_len": 32, "tokens_per_batch": 96, "eval_fraction": 0.1},
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0},
        "training": {"max_steps": 6, "learning_rate": 5e-3, "warmup_steps": 1, "save_every": 0,
                     "eval_every": eval_every},
        "speed": {"step_graphs": step_graphs},
        "output": {"dir": str(out), "name": "run"},
    })  # fmt: skip


def losses_of(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_short_of_memory_beside_the_graphs_drops_them_and_trains_the_same_rows(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs on (the CPU stand-in for capture); the first micro-batch after a capture runs out of memory: the
    graphs go, the step is retried on the same rows without lowering the batch, and the losses follow the eager
    run."""
    from engine.events import OomRecovered, SpeedChanged, StepMetrics
    from engine.train import run

    reference = list(run(run_config(tiny_model_dir, chat_file, tmp_path / "eager", step_graphs=False)))
    monkeypatch.setattr(step_graphs, "resolve", lambda requested, problem: (bool(requested), "switched on"))
    monkeypatch.setattr(step_graphs.CudaGraphCapture, "__call__", lambda self, f: ReplayingCapture()(f))
    real_run, raised = StepGraphs.run, []

    def short_twice(self: StepGraphs, tree: Any, body: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        if self.captured and len(raised) < 2:  # the retry with the same settings runs short too
            raised.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_run(self, tree, body)

    monkeypatch.setattr(StepGraphs, "run", short_twice)
    events = list(run(run_config(tiny_model_dir, chat_file, tmp_path / "graphs", step_graphs=True)))
    recovered = [(e.action, e.tokens_per_batch) for e in events if isinstance(e, OomRecovered)]
    assert len(raised) == 2 and recovered == [("retry", 96), ("step_graphs", 96)]  # no budget lowered
    changed = [e.state["step_graphs"] for e in events if isinstance(e, SpeedChanged)]
    assert changed and "ran short beside the step graphs" in changed[-1]["reason"] and not changed[-1]["on"]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in reference if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert losses_of(tmp_path / "graphs" / "run") == pytest.approx(losses_of(tmp_path / "eager" / "run"), rel=1e-4)


@pytest.mark.parametrize(("replay_ms", "on"), [(300.0, True), (425.0, True), (430.0, False)])  # a near-tie keeps them
def test_a_run_reports_the_trials_verdict_and_trains_every_step(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replay_ms: float,
    on: bool,
) -> None:  # fmt: skip
    """Automatic step graphs (the CPU stand-in for capture, timed as given): the run says the first steps time
    them, what the trial found as soon as it finds it, and trains the eager run's curve either way."""
    from engine.events import Notice, SpeedChanged, StepMetrics
    from engine.train import run

    list(run(run_config(tiny_model_dir, chat_file, tmp_path / "eager", step_graphs=False)))
    monkeypatch.setattr(step_graphs, "resolve", lambda requested, problem: (True, "automatic: trying"))
    monkeypatch.setattr(warm_up, "pays_back", lambda estimate, micro_batches: True)  # the trial is under test here
    monkeypatch.setattr(step_graphs.CudaGraphCapture, "__call__", lambda self, f: ReplayingCapture()(f))
    made: list[FakeInterval] = []

    def timer() -> FakeInterval:
        made.append(FakeInterval(420.0 if not made else replay_ms))
        return made[-1]

    post_init = StepGraphs.__post_init__

    def with_timer(self: StepGraphs) -> None:
        post_init(self)
        self.timer = timer

    monkeypatch.setattr(StepGraphs, "__post_init__", with_timer)
    config = run_config(tiny_model_dir, chat_file, tmp_path / "auto", step_graphs=False)
    config.speed.step_graphs = None
    events = list(run(config))
    verdicts = [e for e in events if isinstance(e, SpeedChanged) and "replayed" in e.state["step_graphs"]["reason"]]
    assert len(verdicts) == 1 and len(made) == 2, [
        e.state["step_graphs"] for e in events if isinstance(e, SpeedChanged)
    ]
    state = verdicts[0].state["step_graphs"]
    assert state["on"] is on and state["reason"].startswith(f"automatic: {'on' if on else 'off'}; a replayed")
    notes = [e.message for e in events if isinstance(e, Notice) and e.message.startswith("the first steps")]
    assert notes == ["the first steps time step graphs against eager steps; the steps after them run at full speed"]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert losses_of(tmp_path / "auto" / "run") == pytest.approx(losses_of(tmp_path / "eager" / "run"), rel=1e-4)


def test_an_evaluation_short_of_memory_beside_the_graphs_drops_them_first(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.events import EvalMetrics, OomRecovered, SpeedChanged
    from engine.run import step as step_module
    from engine.train import run

    monkeypatch.setattr(step_graphs, "resolve", lambda requested, problem: (bool(requested), "switched on"))
    monkeypatch.setattr(step_graphs.CudaGraphCapture, "__call__", lambda self, f: ReplayingCapture()(f))
    real_eval, raised = step_module.evaluate_loss, []

    def short_once(session: Any) -> Any:
        if session.speed.graphs.captured and not raised:
            raised.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_eval(session)

    monkeypatch.setattr(step_module, "evaluate_loss", short_once)
    events = list(run(run_config(tiny_model_dir, chat_file, tmp_path, step_graphs=True, eval_every=3)))
    assert raised and not [e for e in events if isinstance(e, OomRecovered)]  # the eval batch was not lowered
    assert [e.step for e in events if isinstance(e, EvalMetrics)] == [3, 6]
    changed = [e.state["step_graphs"] for e in events if isinstance(e, SpeedChanged)]
    assert "ran short beside the step graphs" in changed[-1]["reason"]


def test_a_run_that_cannot_replay_keeps_them_off_whatever_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_graphs, "resolve", lambda requested, problem: (bool(requested), "switched on"))
    model = tiny_lora_model("llama")
    controller = SpeedController(model, dataclasses.replace(AUTO, step_graphs=True), torch.device("cpu"))
    assert controller.graphs.active
    controller.refuse_step_graphs("several GPUs: DDP/FSDP hooks run in every backward")
    assert not controller.graphs.on and controller.state()["step_graphs"]["reason"].startswith("off: several GPUs")
    controller.apply(dataclasses.replace(AUTO, step_graphs=True))  # switched on again from the app
    assert not controller.graphs.on and "several GPUs" in controller.state()["step_graphs"]["reason"]
    controller.apply(AUTO)  # automatic (off here) says its own reason
    assert not controller.graphs.on and "several GPUs" not in controller.state()["step_graphs"]["reason"]
