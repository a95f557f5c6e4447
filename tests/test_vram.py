"""The true memory peak of a step (engine.hardware.vram): reserved memory, step graphs' pool included, and the
driver's view through NVML; carried by StepMetrics and the bench; the bench's stock row is stock.

No GPU here: the CUDA allocator's counters and pynvml are stand-ins with the figures of a step-graph row (the
graph pool reserved, not allocated, between replays)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from engine.config import SpeedConfig
from engine.distributed.launch import event_from_dict
from engine.events import StepMetrics
from engine.hardware import vram

GIB = 1 << 30
CUDA = torch.device("cuda", 0)
RESERVED, ALLOCATED = int(78.9 * GIB), int(2.6 * GIB)
"""The Llama-3.2-1B 16,384-token bench row with step graphs: 2.60 GiB allocated at the peak, 78.9 GiB reserved."""


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """torch.cuda's peak counters as a step-graph row leaves them; returns the devices whose peak was reset."""
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: RESERVED)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: ALLOCATED)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    return resets


class NVMLError(Exception):
    pass


def fake_nvml(processes: list[Any], fail: str | None = None, uuid_seen: list[str] | None = None) -> ModuleType:
    """A pynvml stand-in listing ``processes`` on every device; ``fail`` names the call that raises NVMLError."""
    calls: dict[str, int] = {}

    def call(name: str, result: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        if name == fail:
            raise NVMLError(name)
        return result

    module = ModuleType("pynvml")
    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    module.nvmlInit = lambda: call("nvmlInit", None)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByUUID = lambda uuid: (  # type: ignore[attr-defined]
        (uuid_seen.append(uuid) if uuid_seen is not None else None) or call("nvmlDeviceGetHandleByUUID", "handle")
    )
    module.nvmlDeviceGetHandleByIndex = lambda index: call("nvmlDeviceGetHandleByIndex", "handle")  # type: ignore[attr-defined]
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: call(  # type: ignore[attr-defined]
        "nvmlDeviceGetComputeRunningProcesses", processes
    )
    return module


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Installs a pynvml stand-in (``nvml(processes, fail=...)``) on a CUDA device 0 whose UUID is known."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="58f2-aa"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    vram._nvml_handle.cache_clear()

    def install(processes: list[Any], fail: str | None = None, uuid_seen: list[str] | None = None) -> ModuleType:
        module = fake_nvml(processes, fail, uuid_seen)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    yield install
    vram._nvml_handle.cache_clear()


def process(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used)


# --- the measure ---------------------------------------------------------------------------------------------------


def test_the_true_peak_counts_the_step_graphs_pool_reserved_between_replays(allocator: list[torch.device]) -> None:
    vram.reset_step_peak(CUDA)
    peak = vram.read_step_peak(CUDA, driver=False)
    assert allocator == [CUDA]
    assert peak == vram.MemoryPeak(reserved=RESERVED, allocated=ALLOCATED, driver=None)
    assert peak.true_peak == RESERVED  # 78.9 GiB, not the 2.60 GiB the allocated counter saw


def test_the_true_peak_is_never_below_the_allocated_peak() -> None:
    assert vram.MemoryPeak(reserved=GIB, allocated=2 * GIB).true_peak == 2 * GIB
    assert vram.MemoryPeak(reserved=3 * GIB, allocated=2 * GIB).true_peak == 3 * GIB


def test_on_the_cpu_the_peak_is_the_resident_memory_and_nothing_is_reset(
    monkeypatch: pytest.MonkeyPatch, allocator: list[torch.device]
) -> None:
    monkeypatch.setattr(vram, "process_resident_bytes", lambda: 123_456_789)
    vram.reset_step_peak(torch.device("cpu"))
    assert allocator == []
    assert vram.read_step_peak(torch.device("cpu")) == vram.MemoryPeak(123_456_789, 123_456_789, None)


def test_the_real_resident_memory_is_this_process_s() -> None:
    import psutil

    resident = vram.process_resident_bytes()
    assert 0.5 * psutil.Process().memory_info().rss < resident < 2 * psutil.Process().memory_info().rss


def test_a_training_step_reports_the_true_peak(allocator: list[torch.device]) -> None:
    """engine.run.step's measure of a step (what StepMetrics.memory_bytes and each rank's figure carry)."""
    from engine.run.step import _memory_bytes

    assert _memory_bytes(CUDA) == RESERVED


# --- the driver's view ---------------------------------------------------------------------------------------------


def test_the_driver_figure_is_this_process_s_on_this_device(nvml: Any, allocator: list[torch.device]) -> None:
    uuids: list[str] = []
    module = nvml([process(os.getpid() + 1, 50 * GIB), process(os.getpid(), 80 * GIB)], uuid_seen=uuids)
    assert vram.driver_bytes(CUDA) == 80 * GIB
    assert uuids == ["GPU-58f2-aa"]  # matched by UUID: torch's and NVML's device order may differ
    assert vram.read_step_peak(CUDA) == vram.MemoryPeak(RESERVED, ALLOCATED, 80 * GIB)
    assert vram.driver_bytes(torch.device("cuda")) == 80 * GIB  # no index: the current device
    assert module.calls["nvmlInit"] == 1 and module.calls["nvmlDeviceGetHandleByUUID"] == 1  # the handle is cached
    assert module.calls["nvmlDeviceGetComputeRunningProcesses"] == 3  # one driver call per reading


@pytest.mark.parametrize("fail", ["nvmlInit", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetComputeRunningProcesses"])
def test_an_nvml_failure_gives_no_driver_figure(nvml: Any, allocator: list[torch.device], fail: str) -> None:
    nvml([process(os.getpid(), 80 * GIB)], fail=fail)
    assert vram.driver_bytes(CUDA) is None
    assert vram.read_step_peak(CUDA) == vram.MemoryPeak(RESERVED, ALLOCATED, None)  # the allocator's figures stay


@pytest.mark.parametrize(
    "processes",
    [
        [],  # this process is not listed (a container's own process ids)
        [process(os.getpid(), None)],  # Windows WDDM: no per-process figure
        [process(os.getpid(), (1 << 64) - 1)],  # NVML_VALUE_NOT_AVAILABLE
    ],
)
def test_no_figure_where_the_driver_does_not_tell_it(nvml: Any, processes: list[Any]) -> None:
    nvml(processes)
    assert vram.driver_bytes(CUDA) is None


def test_without_pynvml_or_on_the_cpu_there_is_no_driver_figure(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert vram.driver_bytes(CUDA) is None
    assert vram.driver_bytes(torch.device("cpu")) is None


# --- the events ----------------------------------------------------------------------------------------------------


def test_step_metrics_carry_the_driver_figure_through_json_and_ranks() -> None:
    step = StepMetrics(1, 10, 0.1, 2.0, 1e-4, 0.5, 4096, 4000, 0.3, 13653.3, RESERVED, [RESERVED, GIB], 80 * GIB)
    raw = json.loads(json.dumps(step.to_dict()))
    assert raw["memory_bytes"] == RESERVED and raw["driver_memory_bytes"] == 80 * GIB
    assert event_from_dict(raw) == step  # a rank's event, as the launcher rebuilds it
    older = {key: value for key, value in raw.items() if key != "driver_memory_bytes"}
    assert event_from_dict(older) == dataclasses.replace(step, driver_memory_bytes=None)  # logs from before it


def test_a_run_reports_each_step_s_driver_figure(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.config import RunConfig
    from engine.train import run

    readings = iter(range(1, 100))
    monkeypatch.setattr(vram, "driver_bytes", lambda device: next(readings) * GIB)
    config = RunConfig.from_dict({
        "model": {"name": str(tiny_model_dir)},
        "data": {"path": str(chat_file), "max_seq_len": 32, "tokens_per_batch": 48, "eval_fraction": 0.0},
        "lora": {"rank": 4},
        "training": {"max_steps": 3, "save_every": 0, "eval_every": 0},
        "output": {"dir": str(tmp_path), "name": "run"},
    })  # fmt: skip
    steps = [e for e in run(config) if isinstance(e, StepMetrics)]
    assert [s.driver_memory_bytes for s in steps] == [GIB, 2 * GIB, 3 * GIB]  # one reading a step
    assert all(s.memory_bytes > 0 for s in steps)  # on the CPU: the resident memory
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["driver_memory_bytes"] for r in logged] == [GIB, 2 * GIB, 3 * GIB]


def test_the_cli_summary_names_the_peak_plainly() -> None:
    from engine.cli.progress import ProgressPrinter, peak_memory_line
    from engine.events import RunFinished

    printer = ProgressPrinter()
    printer.device = "cuda:0"
    for memory, driver in ((6 * GIB, None), (RESERVED, 80 * GIB), (7 * GIB, 79 * GIB)):
        printer.handle(StepMetrics(1, 3, 0.1, 2.0, 1e-4, 0.5, 64, 60, 0.1, 640.0, memory, None, driver))
    printer.handle(RunFinished(3, "run", "run/adapter", 1.5, None, 2.0))
    assert "peak GPU memory (reserved): 78.90 GiB (80.00 GiB as the driver sees it" in printer.summary()
    assert peak_memory_line("cpu", GIB, None) == "peak process memory (resident): 1.00 GiB"


# --- the stock row ---------------------------------------------------------------------------------------------------

SWITCHES = [f.name for f in dataclasses.fields(SpeedConfig) if f.default is None]
"""Every on/off switch (None: automatic by default), step graphs among them."""


def stock_rows() -> dict[str, SpeedConfig]:
    from engine.bench import long_context, multi_gpu, qlora, speed

    return {
        "speed": speed.STOCK,
        "speed+standard_ckpt": speed.DENSE_VARIANTS["stock+standard_ckpt"],
        "qlora": qlora.variant_settings("stock"),
        "long_context": long_context.speed_settings("stock"),
        "multi_gpu": multi_gpu.speed_settings("stock"),
    }


@pytest.mark.parametrize("name", ["speed", "speed+standard_ckpt", "qlora", "long_context", "multi_gpu"])
def test_every_bench_s_stock_row_has_every_switch_off_step_graphs_included(name: str) -> None:
    stock = stock_rows()[name]
    assert "step_graphs" in SWITCHES and "resident_layers" in SWITCHES and "dequant_once" in SWITCHES
    assert stock.step_graphs is False and stock.fp8_base == "off"
    assert {switch: getattr(stock, switch) for switch in SWITCHES} == dict.fromkeys(SWITCHES, False)
    assert stock.moe_routing == "stock" and stock.checkpointing in ("none", "standard")


def test_a_single_switch_variant_of_the_speed_bench_changes_only_that_switch() -> None:
    from engine.bench.speed import DENSE_VARIANTS, STOCK

    fused = DENSE_VARIANTS["fused_loss"]
    assert fused.fused_loss is True and dataclasses.replace(fused, fused_loss=False) == STOCK
    assert DENSE_VARIANTS["all_on"].step_graphs is False  # all on: the switches ALL_ON names, nothing automatic


def test_the_progress_printer_writes_to_the_stderr_of_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The printer's stream is the stderr in place when a run starts, not the one when the module was imported (a
    host or a test that swaps stderr sees the run's notes)."""
    import io

    from engine.cli.progress import ProgressPrinter
    from engine.events import Notice

    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)
    ProgressPrinter().handle(Notice("rows are padded"))
    assert "note: rows are padded" in swapped.getvalue()
