"""Resident layers: under checkpointing, layers that fit in spare memory keep their activations and skip the
recompute, with the checkpointed path's gradients."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from speed_models import grads, max_relative_error, packed_batch, step, tiny_lora_model

from engine.config import SpeedConfig
from engine.hardware.planner import (
    TrainSetup,
    estimate_memory,
    keeps_layer,
    resident_layers_on_top,
    setup_from_speed_state,
)
from engine.hardware.shapes import load_shape
from engine.speed import GRAPHS_SHORT_OF_MEMORY, SpeedController, resident_layers
from engine.speed.plan import SpeedPlan
from engine.speed.resident_layers import LayerResidency

CPU = torch.device("cpu")
CHECKPOINTED = SpeedConfig(metadata_cache=True, checkpointing="offloaded", resident_layers=False)
RESIDENT = dataclasses.replace(CHECKPOINTED, resident_layers=True)


def four_layer_model(model_type: str = "llama") -> Any:
    torch.manual_seed(0)
    return tiny_lora_model(model_type, num_hidden_layers=4)


def run(
    model: Any, settings: SpeedConfig, resident: int | None = None, controller: SpeedController | None = None
) -> tuple[torch.Tensor, dict, SpeedController]:
    controller = controller or SpeedController(model, settings, CPU)
    controller.resident_override = resident
    controller.apply(settings)
    batch = packed_batch((40, 30, 20))
    model.zero_grad(set_to_none=True)
    loss, _ = step(model, controller.model_inputs(batch), batch)
    return loss.detach(), grads(model), controller


def forward_calls(model: Any) -> list[int]:
    """How many times each decoder layer's attention ran in the last step (forward and recompute)."""
    layers = model.base_model.model.model.layers
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("resident", [1, 2, 4])
def test_resident_layers_give_the_checkpointed_gradients(model_type: str, resident: int) -> None:
    model = four_layer_model(model_type)
    loss_ref, grads_ref, _ = run(model, CHECKPOINTED)
    loss, grads_res, controller = run(model, RESIDENT, resident=resident)
    state = controller.state()["resident_layers"]
    assert state["on"] and state["layers"] == resident and f"{resident} of 4 layers" in state["reason"]
    assert torch.equal(loss, loss_ref)
    assert grads_res.keys() == grads_ref.keys() and grads_ref
    assert all(torch.equal(grads_res[k], grads_ref[k]) for k in grads_ref)  # the same operations, run once


def test_resident_layers_run_once_and_the_others_recompute() -> None:
    model = four_layer_model()
    calls = forward_calls(model)
    run(model, CHECKPOINTED)
    assert calls == [2, 2, 2, 2]
    calls[:] = [0, 0, 0, 0]
    run(model, RESIDENT, resident=2)
    assert sorted(calls) == [1, 1, 2, 2] and calls[1] == calls[3] == 1  # spread over the depth
    calls[:] = [0, 0, 0, 0]
    run(model, RESIDENT, resident=4)
    assert calls == [1, 1, 1, 1]


class SkewedResidency(LayerResidency):
    """Resident layers whose output is off by one part in a thousand."""

    def wrap(self, checkpoint: Any) -> Any:
        plain = super().wrap(checkpoint)

        def run_layer(function: Any, *args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and keeps_layer(self._index, self.share):
                self._index += 1
                out = function(*args, **kwargs)
                return tuple(o * 1.001 for o in out) if isinstance(out, tuple) else out * 1.001
            return plain(function, *args, **kwargs)

        return run_layer


def test_a_resident_layer_that_computed_differently_would_show() -> None:
    """The comparison can fail: a skewed resident layer changes the gradients past the tolerance."""
    model = four_layer_model()
    _, grads_ref, _ = run(model, CHECKPOINTED)
    controller = SpeedController(model, CHECKPOINTED, CPU)
    controller.residency = SkewedResidency()
    controller.plan = SpeedPlan()  # nothing installed: the next apply sets the checkpoint function again, skewed
    _, grads_bad, _ = run(model, RESIDENT, resident=2, controller=controller)
    assert controller.resident_layers == 2
    assert not max_relative_error(grads_bad, grads_ref) <= 1e-6


def test_switching_off_and_without_checkpointing() -> None:
    model = four_layer_model()
    _, _, controller = run(model, RESIDENT, resident=3)
    assert controller.resident_layers == 3
    controller.apply(CHECKPOINTED)
    state = controller.state()["resident_layers"]
    assert controller.resident_layers == 0 and state["reason"].startswith("switched off")
    controller.apply(dataclasses.replace(RESIDENT, checkpointing="none"))
    assert controller.state()["resident_layers"]["reason"].startswith("only under checkpointing")


def test_automatic_on_the_cpu_keeps_every_layer_checkpointed() -> None:
    model = four_layer_model()
    _, _, controller = run(model, dataclasses.replace(RESIDENT, resident_layers=None))
    state = controller.state()["resident_layers"]
    assert not state["on"] and "GPU's free memory" in state["reason"]


def test_chunks_leave_no_layer_resident() -> None:
    model = four_layer_model()
    _, _, controller = run(model, dataclasses.replace(RESIDENT, chunked_mlp=True), resident=2)
    assert controller.resident_layers == 0 and "chunks" in controller.state()["resident_layers"]["reason"]


def test_giving_up_after_running_short_checkpoints_every_layer_again() -> None:
    model = four_layer_model()
    _, _, controller = run(model, RESIDENT, resident=2)
    assert controller.give_up_resident_layers("ran short")
    assert controller.resident_layers == 0 and controller.residency.share == 0
    assert "ran short" in controller.state()["resident_layers"]["reason"]
    assert not controller.give_up_resident_layers("again")  # nothing left to give up
    controller.apply(RESIDENT)  # a later switch change does not bring them back within the run
    assert controller.resident_layers == 0


def test_running_short_gives_up_the_resident_layers_before_the_step_graphs() -> None:
    """A resident layer saves about 1% of a step, the step graphs 15-25%: the first shortage costs the layers."""
    model = four_layer_model()
    _, _, controller = run(model, RESIDENT, resident=2)
    graphs_given_up: list[str] = []
    controller.graphs.give_up = lambda reason: graphs_given_up.append(reason) or True  # type: ignore[method-assign]
    assert controller.give_up_memory() and controller.resident_layers == 0 and not graphs_given_up
    assert controller.give_up_memory() and graphs_given_up == [GRAPHS_SHORT_OF_MEMORY]


def test_layer_residency_spreads_the_share_and_restarts_each_batch() -> None:
    residency = LayerResidency(share=0.5)
    ran: list[str] = []
    run_layer = residency.wrap(lambda fn, *a: ran.append("checkpointed") or fn(*a))
    for _ in range(2):
        residency.begin_batch()
        with torch.enable_grad():
            for _ in range(4):
                run_layer(lambda: ran.append("direct"))
    assert ran.count("direct") == 8 and ran.count("checkpointed") == 4
    assert sum(keeps_layer(i, 3 / 32) for i in range(32)) == 3
    with torch.no_grad():  # evaluation and recompute passes count no layers
        run_layer(lambda: None)
    assert residency._index == 4


def test_resolve_reasons() -> None:
    assert resident_layers.resolve(None, "offloaded", layers=13, total=32) == (
        13,
        "automatic: 13 of 32 layers keep their activations in spare GPU memory and skip the recompute",
    )
    assert resident_layers.resolve(True, "standard", layers=40, total=32)[0] == 32
    assert resident_layers.resolve(None, "offloaded", layers=0, total=32)[1].endswith(
        "no spare GPU memory beside the checkpointed step"
    )
    assert resident_layers.resolve(False, "offloaded", layers=13, total=32)[0] == 0
    assert resident_layers.resolve(None, "none", layers=13, total=32)[0] == 0


def test_the_planner_counts_each_resident_layer_once() -> None:
    """Each resident layer below the top one adds its whole activations to the checkpointed peak; the top one (always
    resident) costs less, since backward frees it before any layer recomputes; all of them resident cost at least
    what no checkpointing does, and the count comes from the recorded switch state."""
    shape = load_shape("llama-3.1-8b")
    setup = TrainSetup(tokens=4096, qlora=True, lora_rank=32, checkpointing="offloaded")
    none = estimate_memory(shape, dataclasses.replace(setup, checkpointing="none")).peak
    peaks = [estimate_memory(shape, dataclasses.replace(setup, resident_layers=n)).peak for n in (0, 1, 2, 3, 32)]
    per_layer = peaks[3] - peaks[2]
    assert peaks[0] < peaks[1] < peaks[2] < peaks[3] < peaks[4] and peaks[2] - peaks[1] == per_layer
    assert 0.5 * 2**30 < per_layer < 1.0 * 2**30  # ~0.7 GiB of activations per 8B layer at 4,096 tokens
    assert peaks[1] - peaks[0] < 0.6 * per_layer
    assert peaks[4] >= none
    state = {"checkpointing": {"mode": "offloaded"}, "resident_layers": {"on": True, "layers": 2}}
    assert setup_from_speed_state(state, shape, 4096).resident_layers == 2
    standard = dataclasses.replace(setup, checkpointing="standard")
    assert estimate_memory(shape, dataclasses.replace(standard, resident_layers=32)).peak >= none


def test_the_planned_count_grows_with_the_budget() -> None:
    """On a GPU the count is the most layers whose planned peak fits the memory this process can reach."""
    model = four_layer_model()
    _, _, controller = run(model, CHECKPOINTED)
    state = controller.state()
    budgets = [2**20 * m for m in range(1, 400, 4)]
    config = controller.hf_model.config
    counts = [resident_layers.planned_layers(model, config, state, 4096, b, (9, 0)) for b in budgets]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4 and len(set(counts)) == 5, counts
    assert resident_layers.planned_layers(model, config, state, 4096, 2**40, (9, 0)) == 4


def test_the_resident_layers_above_the_top_recomputing_layer_are_counted_from_the_spread() -> None:
    """The top layer is always resident; past half the layers, the ones below it are too."""
    on_top = [resident_layers_on_top(n, 32) for n in (0, 1, 4, 16, 17, 20, 25, 31, 32, 40)]
    assert on_top == [0, 1, 1, 1, 2, 2, 4, 31, 32, 32]
