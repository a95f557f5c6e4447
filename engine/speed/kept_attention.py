"""Kept attention: under offloaded checkpointing, backward recomputes only the MLPs.

Why: offloaded checkpointing keeps one tensor per layer and recomputes the whole layer in backward. For a 4-bit
Llama-3.1-8B on one 4,096-token row under an 8 GiB cap on the H200 that recompute cost 1.31-1.36x the step without
checkpointing (411-427 against 313 ms): the q/k/v/o projections with their 4-bit dequantization, rotary, the
attention kernel and the MLP's gate and up projections all ran twice. The attention block's share of that is cheap
to keep instead: what its operations save for backward (the normalised input, q, k, v, the attention output and
the norms' inputs) is about 7 x tokens x hidden bytes per layer, while the MLP's gate/up/activation outputs are
three times the MLP width per token. So with this switch each layer runs with gradients, everything its
operations save goes to pinned host memory as one group per layer (copied on a side stream while the next
layer computes, at most two layers in flight), and the MLP is a recompute unit that keeps only its input
(:meth:`engine.speed.chunked_mlp.ChunkedModules.install_units`). In backward a layer's group comes back while the
layer above runs backward, and only the MLP recomputes (its down projection skipped there by lean recompute).

Cost: host<->device copies, which run on the copy engines beside compute, so they are free only while they take
less time than the forward pass they hide behind; and the saved-tensor hooks' own work per tensor. Measured on
the H200 (Llama-3.1-8B shape, NF4, LoRA r32, one 4,096-token row, 8 GiB cap, PCIe 5.0 x16 at 55 GB/s), it did not
pay: whole-layer recompute 420 ms/step; kept attention on 8, 16, 27 and 32 of the 32 layers 420, 428, 452 and
453 ms. That card computes fast next to its bus; consumer cards compute 4-6x slower on a bus 2x slower, so the
balance there may differ, but it has not been measured. Hence the switch is off unless asked for: switch it on to
measure it on your own card. When on, only a share of the layers keeps what it saves (:func:`kept_share`, spread
evenly; the others send just their input and recompute as before), chosen from the GPU's host link (PCIe
generation and width from NVML) and its 16-bit throughput (:mod:`engine.hardware.gpus`) so that the copies do not
outrun the forward pass. Pinned host memory holds the kept layers' groups, and a layer's group comes back to the
GPU while the layer above runs backward, so it turns itself off where they do not fit the pinned budget, or where
two layers' groups would crowd free GPU memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.hardware.planner import kept_layer_bytes
from engine.hardware.shapes import ModelShape

__all__ = ["DEVICE_FREE_SHARE", "kept_share", "layer_forward_flops", "layer_saved_bytes", "resident_rotary", "resolve"]

DEVICE_FREE_SHARE = 0.25
"""On only while two layers' saved tensors take at most this share of free GPU memory."""
COMPUTE_EFFICIENCY = 0.5
"""Share of the spec sheet's 16-bit throughput a 4-bit layer's forward pass reaches (dequantization, norms and
attention included), for :func:`kept_share`."""
PCIE_LANE_BYTES_PER_S = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
"""Usable bytes/s per lane and direction of each PCIe generation (after encoding)."""
LINK_EFFICIENCY = 0.87
"""Share of the link's rate pinned copies reach (55 of 63 GB/s measured on the H200's PCIe 5.0 x16)."""
DEFAULT_LINK_BYTES_PER_S = 16 * PCIE_LANE_BYTES_PER_S[4] * LINK_EFFICIENCY
"""Assumed when NVML cannot tell: PCIe 4.0 x16, the common desktop slot."""


def layer_forward_flops(config: Any, tokens: int) -> float:
    """Forward FLOPs of one dense decoder layer on one row of ``tokens`` tokens (projections and causal attention)."""
    shape = ModelShape.from_config(config)
    hidden = shape.hidden_size
    projections = hidden * (2 * shape.q_dim + 2 * shape.kv_dim) + 3 * hidden * shape.intermediate_size
    return 2.0 * projections * tokens + 2.0 * tokens * tokens * shape.q_dim


def kept_share(layer_bytes: int, layer_flops: float, link_bytes_per_s: float, device_flops_per_s: float) -> float:
    """The share of layers whose saved tensors can be copied to the host within the forward pass's time."""
    if layer_bytes <= 0 or device_flops_per_s <= 0:
        return 1.0
    copy_s = layer_bytes / link_bytes_per_s
    compute_s = layer_flops / device_flops_per_s
    return max(0.0, min(1.0, compute_s / copy_s))


def host_link_bytes_per_s(device: torch.device) -> float:
    """The GPU's host link in bytes/s per direction, from NVML's PCIe generation and width (the default when NVML
    cannot tell)."""
    try:
        import pynvml

        props = torch.cuda.get_device_properties(device)
        pynvml.nvmlInit()
        try:
            # torch's stubs lack the pci_* fields that its CUDA device properties have
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"  # type: ignore[attr-defined]
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            generation = int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
            width = int(pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, a driver without these queries, or an integrated GPU with no PCIe link
        return DEFAULT_LINK_BYTES_PER_S
    lane = PCIE_LANE_BYTES_PER_S.get(generation)
    return lane * width * LINK_EFFICIENCY if lane and width else DEFAULT_LINK_BYTES_PER_S


def device_flops_per_s(device: torch.device) -> float | None:
    """Expected 16-bit FLOP/s of a 4-bit layer's forward on this GPU, from the built-in table (None: unknown)."""
    from engine.hardware.gpus import find_gpu

    spec = find_gpu(torch.cuda.get_device_name(device))
    return spec.tflops * 1e12 * COMPUTE_EFFICIENCY if spec else None


def layer_saved_bytes(config: Any, tokens: int, dtype_bytes: int = 2) -> int:
    """Estimated bytes one decoder layer saves for backward on ``tokens`` tokens (its attention block and its
    MLP's input): :func:`engine.hardware.planner.kept_layer_bytes`."""
    shape = ModelShape.from_config(config)
    return kept_layer_bytes(shape.hidden_size, shape.kv_dim, tokens, dtype_bytes)


def resolve(
    requested: bool | None,
    checkpointing: str,
    device: torch.device,
    *,
    step_bytes: int,
    layer_bytes: int,
    pinned_left: int,
    free_bytes: int | None,
) -> tuple[bool, str]:
    """(on, reason). ``step_bytes``/``layer_bytes``: what all layers / one layer save for backward on the longest
    row so far; ``pinned_left``: pinned host memory still free in the offloader's budget; ``free_bytes``: free GPU
    memory (None: unknown)."""
    if requested is False:
        return False, "switched off: offloaded checkpointing recomputes whole layers"
    if checkpointing != "offloaded":
        return False, f"only under offloaded checkpointing (checkpointing is {checkpointing})"
    if not requested:
        return False, "automatic: off (measured no faster on the H200); switch it on to measure it on this GPU"
    if device.type == "cuda" and step_bytes > pinned_left:
        return False, (
            f"switched on, but off: the layers' saved tensors ({step_bytes / 2**30:.1f} GiB) exceed the pinned host "
            f"memory left ({pinned_left / 2**30:.1f} GiB)"
        )
    if free_bytes is not None and 2 * layer_bytes > DEVICE_FREE_SHARE * free_bytes:
        return False, (
            f"switched on, but off: two layers' saved tensors ({2 * layer_bytes / 2**20:,.0f} MiB) would crowd free "
            f"GPU memory ({free_bytes / 2**30:.1f} GiB)"
        )
    how = f"backward recomputes only the MLPs; attention activations in host memory ({step_bytes / 2**30:.1f} GiB)"
    return True, f"switched on; {how}"


def resident_rotary(hf_model: torch.nn.Module, keep: Callable[..., None]) -> Any:
    """Hook the model's rotary embedding so that its cos/sin tables, which every layer saves, stay on the device;
    returns the hook handle (None for models without one)."""
    get_decoder = getattr(hf_model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    rotary = getattr(decoder, "rotary_emb", None)
    if not isinstance(rotary, torch.nn.Module):
        return None

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        keep(*(output if isinstance(output, tuple) else (output,)))

    return rotary.register_forward_hook(hook)
