"""The CUDA caching allocator's settings: expandable segments, whatever started CUDA first.

Packed rows change length every step. Without expandable segments the caching allocator keeps fixed-size
segments, fragments, and a planned batch runs out of memory with gigabytes reserved but unused: on the H200, the
4,096-token Llama-3.1-8B QLoRA row under an 8 GiB cap went out of memory at step 2, fell back to slower settings
and trained at 3,950 tokens/s instead of 12,900. ``PYTORCH_CUDA_ALLOC_CONF`` is read once, when CUDA starts, and
the window starts CUDA early (hardware detection), so the setting is made twice:

- :func:`set_at_process_start` puts it in the environment before anything can touch CUDA; every entry point (the
  app, the CLI, the multi-GPU ranks, the benches) calls it first. A user's own choice in the variable is kept.
- :func:`apply_at_run_start` applies it through torch's allocator settings API where CUDA is already up (new
  segments are expandable from then on), and :func:`check` reads the allocator's own segments to say plainly when
  it could not be done (another allocator backend, a torch without the API, the user's ``False``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only where CUDA is in play: the entry points call set_at_process_start first
    import torch

__all__ = ["EXPANDABLE", "AllocatorCheck", "apply_at_run_start", "check", "set_at_process_start", "user_choice"]

EXPANDABLE = "expandable_segments:True"
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch reads both (the second is the newer name); the first set wins in torch, so both are read here."""
HOW_TO_SET = "start TuneDeck with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment"


def user_choice(environ: Mapping[str, str] = os.environ) -> bool | None:
    """The ``expandable_segments`` value the environment names (None where it names none)."""
    for name in VARIABLES:
        for item in environ.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() in ("true", "1")
    return None


def set_at_process_start(environ: MutableMapping[str, str] = os.environ) -> None:
    """Ask for expandable segments in the environment, before CUDA starts; the user's own choice stays."""
    if user_choice(environ) is not None:
        return
    name = next((n for n in VARIABLES if environ.get(n)), VARIABLES[0])
    current = environ.get(name, "")
    environ[name] = f"{current},{EXPANDABLE}" if current else EXPANDABLE


def _settings_api() -> Any:
    """torch's call that changes allocator settings after start-up (its name moved in torch 2.12), or None."""
    import torch

    api = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if api is not None:
        return api
    return getattr(torch.cuda.memory, "_set_allocator_settings", None)


def apply_at_run_start() -> None:
    """Expandable segments for every segment made from now on: in the environment while CUDA is not up, through
    torch's allocator settings API once it is (the window's hardware detection started it). Never raises."""
    import torch

    set_at_process_start()
    if user_choice() is False or not torch.cuda.is_initialized():
        return
    api = _settings_api()
    if api is None or torch.cuda.get_allocator_backend() != "native":
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            api(EXPANDABLE)
    except (RuntimeError, ValueError):
        return  # check() reports what the allocator really does


@dataclass(frozen=True)
class AllocatorCheck:
    """Whether the allocator makes expandable segments, and if not, why and what to do."""

    expandable: bool
    reason: str

    @property
    def warning(self) -> str | None:
        """A notice for the run where the setting could not take effect (None where all is well or not asked)."""
        if self.expandable or self.reason.startswith(("not a CUDA", "switched off")):
            return None
        return f"GPU memory may fragment in long runs: {self.reason}; {HOW_TO_SET}"


def check(device: torch.device) -> AllocatorCheck:
    """What the allocator really does, read from its segments (call once the model is on the GPU)."""
    import torch

    if device.type != "cuda":
        return AllocatorCheck(False, "not a CUDA device")
    if user_choice() is False:
        return AllocatorCheck(False, "switched off in the environment (expandable_segments:False)")
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        return AllocatorCheck(False, f"the {backend} allocator backend has no expandable segments")
    return _from_segments(device)


def _from_segments(device: torch.device) -> AllocatorCheck:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index]
    large = [s for s in segments if s.get("segment_type", "large") == "large"]
    if not large:
        return AllocatorCheck(True, "no memory held yet")
    if any(s.get("is_expandable") for s in large):
        return AllocatorCheck(True, "expandable segments in use")
    if _settings_api() is None:
        return AllocatorCheck(False, "CUDA started before the setting was made and this torch cannot change it later")
    return AllocatorCheck(False, "the allocator's segments are not expandable")
