"""Expandable segments reach the allocator whatever started CUDA first: the environment at every entry point,
torch's settings API at run start, and a plain notice where neither took effect."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.hardware import allocator

VARIABLES = allocator.VARIABLES


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("environ", "choice"),
    [
        ({}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:False"}, False),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:false"}, False),
    ],
)
def test_the_users_choice_is_read_from_either_variable(environ: dict[str, str], choice: bool | None) -> None:
    assert allocator.user_choice(environ) is choice


def test_the_setting_joins_other_settings_and_never_overrides_the_user() -> None:
    empty: dict[str, str] = {}
    allocator.set_at_process_start(empty)
    assert empty == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    other = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    allocator.set_at_process_start(other)
    assert other == {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}
    refused = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    allocator.set_at_process_start(refused)
    assert refused == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


def test_the_app_sets_it_before_the_window_and_its_hardware_detection(clean_environment: Any) -> None:
    import app.__main__ as entry
    import app.main_window

    seen: list[str | None] = []
    clean_environment.setattr(app.main_window, "run_app", lambda argv: seen.append(os.environ.get(VARIABLES[0])) or 0)
    clean_environment.setattr(entry, "has_display", lambda args=(): True)
    assert entry.main([]) == 0
    assert seen == ["expandable_segments:True"]


def test_the_command_line_sets_it_before_any_command(clean_environment: Any) -> None:
    from engine.cli import commands

    seen: list[str | None] = []
    clean_environment.setattr(
        commands, "run_command", lambda name, args: seen.append(os.environ.get(VARIABLES[0])) or 0
    )
    assert commands.main(["train", "--help"]) == 0
    assert seen == ["expandable_segments:True"]


class FakeAllocator:
    """torch.cuda's allocator calls, as on a GPU where CUDA is already up."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, segments: list[dict[str, Any]], backend: str = "native"):
        self.applied: list[str] = []
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", self.applied.append, raising=False)


# A run started after CUDA trains with expandable segments: tests/test_reliability_gpu.py's
# test_a_run_started_after_cuda_trains_with_expandable_segments checks it on a real GPU (on a CPU build torch's
# settings call accepts any text, so a test here could only check a fake).


def test_the_users_false_is_respected_after_cuda_started_too(clean_environment: Any) -> None:
    clean_environment.setenv(VARIABLES[0], "expandable_segments:False")
    fake = FakeAllocator(clean_environment, segments=[{"device": 0, "segment_type": "large", "is_expandable": False}])
    allocator.apply_at_run_start()
    assert fake.applied == []
    assert allocator.check(torch.device("cuda", 0)).warning is None  # the user's choice: nothing to warn about


@pytest.mark.parametrize(
    ("segments", "backend", "expandable", "says"),
    [
        ([{"device": 0, "segment_type": "large", "is_expandable": True}], "native", True, None),
        ([{"device": 0, "segment_type": "small", "is_expandable": False}], "native", True, None),
        ([{"device": 0, "segment_type": "large", "is_expandable": False}], "native", False, "not expandable"),
        ([], "cudaMallocAsync", False, "cudaMallocAsync allocator backend"),
    ],
)
def test_the_run_reads_what_the_allocator_really_does(
    clean_environment: Any, segments: list[dict[str, Any]], backend: str, expandable: bool, says: str | None
) -> None:
    FakeAllocator(clean_environment, segments, backend)
    checked = allocator.check(torch.device("cuda", 0))
    assert checked.expandable is expandable
    if says is None:
        assert checked.warning is None
    else:
        assert checked.warning is not None and says in checked.warning
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in checked.warning


def test_on_the_cpu_there_is_nothing_to_check() -> None:
    checked = allocator.check(torch.device("cpu"))
    assert not checked.expandable and checked.warning is None
