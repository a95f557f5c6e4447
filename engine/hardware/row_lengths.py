"""How long a training row is: the longest example (``data.max_seq_len``) and the tokens of one packed row
(``data.tokens_per_batch``), when the user left them automatic (0).

On a GPU the automatic values are the long-standing defaults, 2,048 and 4,096 tokens. On a CPU those rows are far
too slow: a 135M-parameter model took about 128 s a step with 4,096-token rows on two cores. There a step's time
is set by the row's matmuls and its attention, which on the CPU runs over the whole packed row (the mask keeps the
documents apart, the work is still T x T), so the row follows the model and the data instead:

* tokens per batch: the longest row the CPU trains in about :data:`CPU_STEP_SECONDS` (from the model's FLOPs per
  token and :data:`CPU_GFLOPS_PER_CORE` a thread), in steps of :data:`ROW_MULTIPLE`, never over the GPU's 4,096;
* row length: the longest document rounded up to :data:`ROW_MULTIPLE` (nothing is cut that need not be), at most
  that budget.

A value the user set is kept; the other follows it (an explicit ``tokens_per_batch`` of 256 makes the automatic
row length at most 256). :func:`choose_row_lengths` is pure: the run, ``tunedeck plan`` and the app ask it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.hardware.shapes import ModelShape

GPU_MAX_SEQ_LEN = 2048
"""The automatic row length on a GPU (unchanged since the first release)."""
GPU_TOKENS_PER_BATCH = 4096
"""The automatic tokens per packed row on a GPU."""
ROW_MULTIPLE = 64
"""Automatic lengths are multiples of this (whole SIMD tiles; no odd shapes)."""
CPU_SHORTEST_ROW = 128
"""The CPU budget never goes below this: shorter rows would cut ordinary chats, and the run says how slow it is."""
CPU_STEP_SECONDS = 2.0
"""The step time the CPU budget aims at: short steps, since on a CPU a step costs about its tokens and a small set
learns from many small updates (the demo: 2 passes of 256-token rows as well as 4 of 1,024); a busy machine (other
programs on the same cores) stretches a step past its estimate."""
CPU_GFLOPS_PER_CORE = 60.0
"""Effective float32 training throughput of one CPU thread (matmuls, attention and everything between), for the time
a run says it takes. Measured through ``tunedeck train`` on the real SmolLM2-135M-Instruct, LoRA, a 2-core x86-64 VM:
67 GFLOP/s a thread on 384-token rows with two threads (1.78 s a step), 57-79 with one thread on 192-token rows
(1.40-1.95 s) while another run used the other core. (A loaded VM, load average 6-7, measured 19-52.)"""
CPU_LAYER_OVERHEAD_S = 0.004
"""Time a step spends per decoder layer beside its arithmetic (Python, operator dispatch): what sets a tiny model's
pace (the demo model, 4 layers: about 0.03 s a step of 256 tokens, twice its FLOPs' time)."""
CPU_QLORA_SLOWDOWN = 2.5
"""How many times longer a QLoRA token takes than a LoRA token on the CPU, where bitsandbytes dequantizes every 4-bit
weight on every use with no fused CPU kernel. Measured through ``tunedeck train`` on the 135M shape, one thread, a
2-core VM with a load average of 6-9 from other programs: 128-token QLoRA rows 4.9-9.0 s a step, 192-token LoRA rows
3.4-5.0 s."""


@dataclass(frozen=True)
class RowLengths:
    """The row length and tokens per batch a run uses, each with the one-line reason a user reads."""

    max_seq_len: int
    tokens_per_batch: int
    max_seq_len_reason: str
    tokens_per_batch_reason: str

    def lines(self) -> list[str]:
        return [
            f"row length {self.max_seq_len:,} tokens: {self.max_seq_len_reason}",
            f"tokens per batch {self.tokens_per_batch:,}: {self.tokens_per_batch_reason}",
        ]


def round_up(tokens: int, multiple: int = ROW_MULTIPLE) -> int:
    return max(multiple, math.ceil(tokens / multiple) * multiple)


def cpu_flops_per_token(shape: ModelShape, row_tokens: int) -> float:
    """Training FLOPs per token on the CPU: forward and input gradients through every weight (2N + 2N, the base is
    frozen), and attention over the whole packed row of ``row_tokens`` (QK^T and AV, forward and about twice that
    backward)."""
    dense = 4 * shape.active_params_per_token()
    attention = 4 * shape.num_layers * shape.q_dim * row_tokens * 3
    return dense + attention


def cpu_step_seconds(shape: ModelShape, row_tokens: int, cores: int, qlora: bool = False) -> float:
    """The estimated time of one step of one ``row_tokens``-token row on ``cores`` CPU cores."""
    rate = max(cores, 1) * CPU_GFLOPS_PER_CORE * 1e9 / (CPU_QLORA_SLOWDOWN if qlora else 1.0)
    return row_tokens * cpu_flops_per_token(shape, row_tokens) / rate + shape.num_layers * CPU_LAYER_OVERHEAD_S


def cpu_token_budget(shape: ModelShape, cores: int, qlora: bool = False) -> int:
    """The longest row (a multiple of ROW_MULTIPLE, CPU_SHORTEST_ROW to GPU_TOKENS_PER_BATCH) estimated to train in
    CPU_STEP_SECONDS on ``cores`` cores."""
    tokens = GPU_TOKENS_PER_BATCH
    while tokens > CPU_SHORTEST_ROW and cpu_step_seconds(shape, tokens, cores, qlora) > CPU_STEP_SECONDS:
        tokens -= ROW_MULTIPLE
    return tokens


def choose_row_lengths(
    *,
    on_gpu: bool,
    max_seq_len: int = 0,
    tokens_per_batch: int = 0,
    longest_document: int | None = None,
    shape: ModelShape | None = None,
    cpu_cores: int = 1,
    qlora: bool = False,
    documents_per_item: int = 1,
) -> RowLengths:
    """The row length and tokens per batch for a run; 0 means automatic, any other value is the user's and kept.

    ``longest_document``: the longest tokenized example (None: the data is not read yet); ``shape``: the model
    (None: unknown, the CPU budget is then the GPU's); ``cpu_cores``: the threads torch trains with (one a core);
    ``documents_per_item``: 2 where a packed item is a preference pair (both answers share a row)."""
    if on_gpu:
        budget, budget_why = GPU_TOKENS_PER_BATCH, "the GPU default"
    elif shape is None:
        budget, budget_why = GPU_TOKENS_PER_BATCH, "no model to size the CPU budget by"
    else:
        budget = cpu_token_budget(shape, cpu_cores, qlora)
        seconds = cpu_step_seconds(shape, budget, cpu_cores, qlora)
        cores = f"{cpu_cores} CPU thread{'s' if cpu_cores != 1 else ''}"
        pace = f"about {seconds:.0f} s a step" if seconds >= 1 else "under a second a step"
        budget_why = f"{pace} for {shape.display_name()} on {cores}"
        if budget == CPU_SHORTEST_ROW and seconds > CPU_STEP_SECONDS:
            budget_why += " (the shortest row TuneDeck picks on a CPU; this model is slow here)"
    items = max(1, documents_per_item)
    row_budget = max(ROW_MULTIPLE, budget // items // ROW_MULTIPLE * ROW_MULTIPLE)
    row, row_why = _row_length(on_gpu, max_seq_len, tokens_per_batch // items, longest_document, row_budget, budget_why)
    tokens, tokens_why = _tokens_per_batch(on_gpu, tokens_per_batch, row * items, max_seq_len, budget, budget_why)
    return RowLengths(row, tokens, row_why, tokens_why)


def _row_length(
    on_gpu: bool, given: int, tokens_given: int, longest: int | None, budget: int, budget_why: str
) -> tuple[int, str]:
    if given:
        return given, "set by you"
    if on_gpu:
        if tokens_given and tokens_given < GPU_MAX_SEQ_LEN:
            return tokens_given, f"the GPU default {GPU_MAX_SEQ_LEN:,}, lowered to your tokens per batch"
        return GPU_MAX_SEQ_LEN, "the GPU default; longer examples are cut (or dropped, with --overlong drop)"
    cap, cap_why = min(budget, GPU_MAX_SEQ_LEN), f"the CPU budget: {budget_why}"
    if tokens_given and tokens_given < cap:
        cap, cap_why = tokens_given, "your tokens per batch"
    if longest is None:
        return cap, f"the longest example rounded up to {ROW_MULTIPLE}, at most {cap:,} ({cap_why})"
    fitted = round_up(longest)
    if fitted <= cap:
        return fitted, f"the longest example ({longest:,} tokens) rounded up to a multiple of {ROW_MULTIPLE}"
    return cap, f"the longest example has {longest:,} tokens; examples are cut at {cap:,} ({cap_why})"


def _tokens_per_batch(
    on_gpu: bool, given: int, row: int, row_given: int, budget: int, budget_why: str
) -> tuple[int, str]:
    if given:
        return given, "set by you"
    if row > budget:
        whose = "your row length" if row_given else "the row length"
        return row, f"one row holds the longest item ({whose}: {row:,} tokens); over {budget_why}"
    if on_gpu:
        return budget, "the GPU default"
    return budget, f"{budget_why}; --grad-accum N sums N such rows into one optimizer step"
