"""A/B measurement of one speed switch on the running job: alternate it on and off, compare tokens/s.

Each round runs the switch on for a block of steps and off for another (the order alternates between rounds,
so a slow drift in speed, e.g. a GPU warming up, does not favour one side). The first step of every block is
not counted: it may carry one-off costs of the change (a compile, a cache refill); step graphs leave out two (their
first row of a shape runs eagerly, the second is captured). The result is the mean
speedup over rounds with its spread (standard deviation), so a user sees how much of a difference is noise.
Qt-free: the speed page feeds it events and applies the settings it asks for.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from engine.config import SpeedConfig

ALL = "all"
"""The pseudo-switch of "all on vs all off"."""
SPEED_SWITCHES = ("metadata_cache", "fused_loss", "lora_16bit", "fused_kernels", "dequant_once")
"""What "all on vs all off" flips (with MoE routing): the switches that trade nothing for speed. The memory savers
(checkpointing, chunked MLP, host embedding) cost time by design and stay as the run has them."""
TITLES = {
    "metadata_cache": "Packed-sequence metadata caching",
    "fused_loss": "Fused loss (no full logits)",
    "lora_16bit": "LoRA adapters in 16-bit",
    "fused_kernels": "Fused per-token kernels",
    "checkpointing": "Offloaded activation checkpointing",
    "chunked_mlp": "MLP in sequence chunks (long context)",
    "host_embedding": "Input embedding in host memory",
    "dequant_once": "4-bit weights dequantized once per layer",
    "resident_layers": "Layers kept resident in spare memory",
    "fp8_base": "Frozen weights multiplied in fp8",
    "step_graphs": "Micro-batches replayed from CUDA graphs",
    "moe_routing": "MoE routing on sorted tokens",
    ALL: "All speed switches together",
}
ON_OFF_SWITCHES = ("metadata_cache", "fused_loss", "lora_16bit", "fused_kernels", "chunked_mlp", "host_embedding",
                   "dequant_once", "resident_layers", "fp8_base", "step_graphs")  # fmt: skip
"""Switches shown as on or off (the others choose between modes). fp8 products take a value: on is ``all`` (every
frozen product in fp8, as the switch has always meant when switched on), off is ``off``."""
SWITCHES = tuple(name for name in TITLES if name in {f.name for f in dataclasses.fields(SpeedConfig)})
"""The switches this engine has, in the order the speed page lists them."""


def switch_settings(base: SpeedConfig, switch: str, on: bool) -> SpeedConfig:
    """``base`` with one switch on or off; checkpointing compares offloaded against standard recompute.

    :data:`ALL` on is TuneDeck's automatic choice for every speed switch (on wherever it applies here); off is
    every one of them off: stock transformers and peft.
    """
    if switch == ALL:
        flags: dict[str, Any] = {name: None if on else False for name in SPEED_SWITCHES}
        return dataclasses.replace(base, **flags, moe_routing="auto" if on else "stock")
    if switch == "fp8_base":
        return dataclasses.replace(base, fp8_base="all" if on else "off")
    if switch in ON_OFF_SWITCHES:
        flag: dict[str, Any] = {switch: on}
        return dataclasses.replace(base, **flag)
    if switch == "checkpointing":
        return dataclasses.replace(base, checkpointing="offloaded" if on else "standard")
    if switch == "moe_routing":
        return dataclasses.replace(base, moe_routing="sync-free" if on else "stock")
    raise ValueError(f"unknown speed switch {switch!r}")


NEEDS_A_GPU = {
    "step_graphs": "CUDA graphs replay GPU work",
    "checkpointing": "offloading moves activations to host memory, where a CPU run keeps them anyway",
    "fp8_base": "fp8 products need fp8 tensor cores",
    "host_embedding": "a CPU run keeps the whole model in host memory",
    "resident_layers": "it spends spare GPU memory",
}
"""Switches that cannot apply to a run on the CPU, and why: Compare lists them as not applicable there."""


def nothing_to_do(switch: str, state: dict[str, dict[str, object]], device: str = "") -> str | None:
    """Why flipping ``switch`` cannot change anything on this model and device (None when it can); ``device``: the
    run's torch device ("cpu", "cuda:0"; "" when not known)."""
    if device == "cpu" and switch in NEEDS_A_GPU:
        return f"not applicable on the CPU: {NEEDS_A_GPU[switch]}"
    entry = state.get(switch, {})
    reason = str(entry.get("reason", ""))
    if switch == "moe_routing" and "no MoE" in reason:
        return reason
    if switch in ON_OFF_SWITCHES and not entry.get("on") and not reason.startswith(("switched off", "automatic")):
        return reason or "not supported by this model"
    if switch == "checkpointing" and "offloaded requested but" in reason:
        return reason
    return None


@dataclass
class Measurement:
    switch: str
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    skipped_reason: str | None = None
    rounds_planned: int = 0
    """The rounds Compare set out to measure (0: as many as were measured)."""

    @property
    def in_full(self) -> bool:
        """Every planned round was measured (a run that ends first leaves fewer, with no spread worth showing)."""
        return len(self.ratios) >= self.rounds_planned

    @property
    def speedup(self) -> float | None:
        return statistics.fmean(self.ratios) if self.ratios else None

    @property
    def spread(self) -> float:
        return statistics.stdev(self.ratios) if len(self.ratios) > 1 else 0.0

    @property
    def percent(self) -> float | None:
        """The speed-up in percent (negative: slower with the switch on)."""
        return None if self.speedup is None else (self.speedup - 1) * 100

    def short(self) -> str:
        """The result in a few words for a table cell: "+12.3% ± 1.1%"."""
        if self.skipped_reason:
            return "not applicable here" if self.skipped_reason.startswith("not applicable") else "nothing to do here"
        if self.percent is None:
            return "not measured"
        if not self.in_full:
            return f"{self.percent:+.1f}% ({self._rounds()}: not measured in full)"
        return f"{self.percent:+.1f}% ± {self.spread * 100:.1f}%"

    def _rounds(self) -> str:
        return f"{len(self.ratios)} of {self.rounds_planned} round{'s' if self.rounds_planned > 1 else ''}"

    def summary(self) -> str:
        if self.skipped_reason:
            return f"nothing to do: {self.skipped_reason}"
        if self.speedup is None:
            return "not measured (the run ended first)"
        change = (self.speedup - 1) * 100
        word = "faster" if change >= 0 else "slower"
        noise = " (within the noise)" if abs(change) <= self.spread * 100 else ""
        rates = f"{statistics.fmean(self.on):,.0f} vs {statistics.fmean(self.off):,.0f} tokens/s"
        if not self.in_full:
            return f"{abs(change):.1f}% {word} over {self._rounds()}, not measured in full ({rates})"
        return f"{abs(change):.1f}% {word} ± {self.spread * 100:.1f}% over {len(self.ratios)} rounds ({rates}){noise}"


SETTLING_STEPS = {"step_graphs": 2}
"""Steps after a change that a block does not count, where a switch needs more than one to settle: step graphs
run a row shape's first micro-batch eagerly and capture the second (their graphs go at every change)."""


def settling_steps(switch: str) -> int:
    return SETTLING_STEPS.get(switch, 1)


class ABCompare:
    """Drives the measurement step by step; ``next_settings`` says what to request from the run next."""

    def __init__(self, base: SpeedConfig, switch: str, *, rounds: int = 3, block_steps: int = 3) -> None:
        if block_steps < 2:
            raise ValueError("a block needs at least 2 steps: the first one is not counted")
        block_steps = max(block_steps, settling_steps(switch) + 1)  # at least one counted step per block
        self.base, self.switch, self.rounds, self.block_steps = base, switch, rounds, block_steps
        self.result = Measurement(switch, rounds_planned=rounds)
        self._plan = [on for r in range(rounds) for on in ((True, False) if r % 2 == 0 else (False, True))]
        self._block = 0
        self._samples: list[float] = []
        self._waiting_from: int | None = None
        self._round_means: dict[bool, float] = {}

    @property
    def done(self) -> bool:
        return self._block >= len(self._plan)

    def first_settings(self) -> SpeedConfig:
        return switch_settings(self.base, self.switch, self._plan[0])

    def restore_settings(self) -> SpeedConfig:
        return self.base

    def speed_applied(self, step: int) -> None:
        """The engine applied our last request before step ``step + 1``."""
        self._waiting_from = step

    def step_done(self, step: int, tokens_per_s: float) -> SpeedConfig | None:
        """Count one step; returns new settings to request when a block ends (the base settings at the end)."""
        if self.done or self._waiting_from is None or step <= self._waiting_from:
            return None
        self._samples.append(tokens_per_s)
        if len(self._samples) < self.block_steps:
            return None
        self._finish_block()
        self._waiting_from = None
        if self.done:
            return self.restore_settings()
        return switch_settings(self.base, self.switch, self._plan[self._block])

    def _finish_block(self) -> None:
        on = self._plan[self._block]
        mean = statistics.fmean(self._samples[settling_steps(self.switch) :])  # one-off costs of the change
        (self.result.on if on else self.result.off).append(mean)
        self._round_means[on] = mean
        self._samples = []
        self._block += 1
        if self._block % 2 == 0:
            self.result.ratios.append(self._round_means[True] / self._round_means[False])
            self._round_means = {}

    def abandon(self, reason: str) -> SpeedConfig:
        """Stop measuring: the engine showed that the switch changes nothing here; returns the settings to restore."""
        self.result.skipped_reason = reason
        self._block = len(self._plan)
        return self.restore_settings()

    def steps_needed(self) -> int:
        return len(self._plan) * self.block_steps + len(self._plan)
