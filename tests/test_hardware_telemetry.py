"""The telemetry sampler with a faked NVML: samples, one-shot warnings, the CPU path and the thread."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from hang import HANG_S

from engine.events import Event
from engine.hardware.telemetry import SPILL, THROTTLE, TelemetrySample, TelemetrySampler, TelemetryWarning
from tests.hardware_fakes import GIB, FakeGpu, FakeNvml


def sampler_for(gpu: FakeGpu) -> TelemetrySampler:
    sampler = TelemetrySampler(nvml=FakeNvml([gpu]))
    sampler._open()
    return sampler


def test_sample_reads_every_field() -> None:
    gpu = FakeGpu("NVIDIA GeForce RTX 4090", (8, 9), 24, 128, used_gib=10)
    events = sampler_for(gpu).sample_events()
    assert len(events) == 1 and isinstance(events[0], TelemetrySample)
    sample = events[0]
    assert sample.gpu_index == 0 and sample.memory_used_bytes == 10 * GIB and sample.memory_total_bytes == 24 * GIB
    assert sample.utilization_pct == 97 and sample.temperature_c == 55 and sample.power_w == 120
    assert sample.sm_clock_mhz == 1800 and sample.throttle_reasons == ()
    assert sample.to_dict()["kind"] == "TelemetrySample"


def test_spill_into_shared_memory_warns_once() -> None:
    gpu = FakeGpu("NVIDIA GeForce RTX 4060 Laptop GPU", (8, 9), 8, 24)
    gpu.processes = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(9.5 * GIB))]
    sampler = sampler_for(gpu)
    first, again = sampler.sample_events(), sampler.sample_events()
    warnings = [e for e in first if isinstance(e, TelemetryWarning)]
    assert [w.code for w in warnings] == [SPILL] and "shared system memory" in warnings[0].message
    assert not [e for e in again if isinstance(e, TelemetryWarning)]
    gpu.processes = []
    sampler.sample_events()
    gpu.processes = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(9.5 * GIB))]
    assert any(isinstance(e, TelemetryWarning) for e in sampler.sample_events())  # a new episode warns again


def test_thermal_throttle_warns_but_power_cap_does_not() -> None:
    gpu = FakeGpu("NVIDIA GeForce RTX 3090", (8, 6), 24, 82, throttle_mask=0x4)
    sampler = sampler_for(gpu)
    events = sampler.sample_events()
    assert events[0].throttle_reasons == ("software power cap",)  # type: ignore[attr-defined]
    assert len(events) == 1
    gpu.throttle_mask, gpu.temperature = 0x40 | 0x4, 91
    warning = sampler.sample_events()[1]
    assert isinstance(warning, TelemetryWarning) and warning.code == THROTTLE and "91 °C" in warning.message


def test_cpu_path_without_nvml() -> None:
    sampler = TelemetrySampler(nvml=None)
    sampler._open()
    sample = sampler.sample_events()[0]
    assert isinstance(sample, TelemetrySample) and sample.gpu_index is None and sample.memory_used_bytes is None
    assert sample.process_rss_bytes and sample.process_rss_bytes > 10 * 2**20


def test_missing_driver_is_the_cpu_path() -> None:
    sampler = TelemetrySampler(nvml=FakeNvml([], missing_library=True))
    sampler._open()
    assert sampler.sample_events()[0].gpu_index is None  # type: ignore[attr-defined]


def test_thread_delivers_to_callback_and_survives_a_failing_one() -> None:
    got: list[Event] = []
    two = threading.Event()

    def callback(event: Event) -> None:
        got.append(event)
        if len(got) >= 2:
            two.set()
        raise RuntimeError("a broken consumer")

    sampler = TelemetrySampler(callback, interval_s=0.01, nvml=FakeNvml([FakeGpu("NVIDIA H200", (9, 0), 140, 132)]))
    with sampler:
        assert two.wait(HANG_S)
    assert all(isinstance(e, TelemetrySample) for e in got)
    assert sampler._thread is None


def test_queue_delivery() -> None:
    sampler = TelemetrySampler(interval_s=0.01, nvml=None)
    sampler.start()
    try:
        event = sampler.events.get(timeout=HANG_S)
    finally:
        sampler.stop()
    assert isinstance(event, TelemetrySample)


def test_several_gpus_give_one_sample_each_and_warn_per_card() -> None:
    """A run on several GPUs: a lane per card; a spill on card 1 warns for card 1 only, naming it."""
    cards = [FakeGpu("NVIDIA GeForce RTX 3090", (8, 6), 24, 60, used_gib=20) for _ in range(2)]
    sampler = TelemetrySampler(nvml=FakeNvml(cards), device_indices=[0, 1])
    sampler._open()
    cards[1].processes = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(25 * GIB))]
    events = sampler.sample_events()
    samples = [e for e in events if isinstance(e, TelemetrySample)]
    warnings = [e for e in events if isinstance(e, TelemetryWarning)]
    assert [s.gpu_index for s in samples] == [0, 1]
    assert [w.message.split(":")[0] for w in warnings] == ["GPU 1"]
    assert samples[1].process_gpu_memory_bytes == 25 * GIB and samples[0].process_gpu_memory_bytes is None


def test_memory_of_child_processes_counts_as_the_runs() -> None:
    """The ranks of a multi-GPU run are child processes of the app: their GPU memory is the run's."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        gpu = FakeGpu("NVIDIA GeForce RTX 4090", (8, 9), 24, 60)
        gpu.processes = [
            SimpleNamespace(pid=child.pid, usedGpuMemory=3 * GIB),
            SimpleNamespace(pid=1, usedGpuMemory=GIB),
        ]
        sample = sampler_for(gpu).sample_events()[0]
        assert isinstance(sample, TelemetrySample) and sample.process_gpu_memory_bytes == 3 * GIB
    finally:
        child.kill()
        child.wait()
