"""The typed configuration of a training run.

One tree of dataclasses (model, data, LoRA, training, output) is the single place where a setting exists:
the CLI flags and the app's form are generated from the fields' metadata, and the whole tree is saved as
``config.json`` in every run folder so that a run can be reproduced or resumed. Checks live in
``__post_init__`` so a bad value fails where it is set, with a message naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

from engine.errors import ConfigError
from engine.rewards import RewardSpec, parse_reward_flag

DEMO_MODEL = "demo"
"""``model.name`` of the built-in demo model, which ships with TuneDeck (see :func:`demo_model_dir`)."""


def demo_model_dir() -> Path:
    """The folder of the built-in demo model (a Hugging Face folder in the ``resources`` package)."""
    import resources

    return Path(resources.__file__).parent / "demo" / "model"


def data_dir() -> Path:
    """The user's TuneDeck data folder (``TUNEDECK_HOME`` overrides it, e.g. in tests)."""
    override = os.environ.get("TUNEDECK_HOME")
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "TuneDeck"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "TuneDeck"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tunedeck"


HELD_OUT_SHARE = 0.12
MIN_HELD_OUT = 8
"""Fewer held-out examples than this choose a best adapter by chance (4 of 70 did, at 5%)."""
MAX_HELD_OUT = 200
TOO_FEW_TO_HOLD_OUT = 16
"""Sets smaller than this train on every example: none can be spared to evaluate on."""


def held_out_count(examples: int) -> int:
    """Examples split off for evaluation: about 12%, at least 8 and at most 200; none from a tiny set."""
    if examples < TOO_FEW_TO_HOLD_OUT:
        return 0
    return min(MAX_HELD_OUT, max(MIN_HELD_OUT, round(examples * HELD_OUT_SHARE)))


def setting(default: Any, help: str, flag: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its help text (and optional CLI flag name and choices) attached as metadata."""
    meta: dict[str, Any] = {"help": help}
    if flag:
        meta["flag"] = flag
    if choices:
        meta["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{name}: {message}")


RUN_NAME_MAX_CHARS = 120
RUN_NAME_MAX_BYTES = 240
"""A run name's longest: 120 characters and 240 bytes in UTF-8, so that the folder fits every file system's limit
of 255 (bytes on Linux and macOS, UTF-16 units on Windows) with room for the suffix a clashing default name gets."""
WINDOWS_RESERVED_NAMES = frozenset(
    ["CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"]
    + [f"{port}{digit}" for port in ("COM", "LPT") for digit in "123456789\u00b9\u00b2\u00b3"]
)
"""Device names Windows refuses as a file or folder name, with any extension (``nul.txt`` too), in any case."""
WINDOWS_REFUSED_CHARACTERS = '<>:"|?*'


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a run's name ("is empty", "contains '/': ..."), or None when it can. A run name is
    one plain folder name, the same on Linux, macOS and Windows, so that the run folder is always a direct child of
    the output folder (``tunedeck train --name ..`` once wrote a run into the current folder)."""
    if not name:
        return "is empty"
    if not name.strip():
        return "is blank"
    if name == ".":
        return "is the output folder itself, not a folder of its own"
    if name == "..":
        return "is the output folder's parent, not a folder of its own"
    for char in name:
        if char in "/\\":
            return f"contains {char!r}: a run name is one folder name, not a path"
        if unicodedata.category(char) == "Cc":
            return f"contains the control character {char!r}"
        if unicodedata.category(char) == "Cs":
            return f"contains {char!r}, half of a character pair, which no file name can hold"
        if char in WINDOWS_REFUSED_CHARACTERS:
            return f"contains {char!r}, which Windows refuses in a folder name"
    if name.endswith("."):
        return "ends with a dot, which Windows drops from folder names"
    if name != name.strip():
        return "begins or ends with white space (Windows drops spaces at the end of folder names)"
    device = name.split(".")[0].rstrip(" ").upper()
    if device in WINDOWS_RESERVED_NAMES:
        return f"is a device name Windows reserves ({device}), with or without an extension"
    if len(name) > RUN_NAME_MAX_CHARS or len(name.encode("utf-8")) > RUN_NAME_MAX_BYTES:
        return f"is too long (at most {RUN_NAME_MAX_CHARS} characters and {RUN_NAME_MAX_BYTES} bytes in UTF-8)"
    return None


def _gpus_spec_ok(spec: str) -> bool:
    """'all', a count of at least 1, or distinct GPU indices separated by commas."""
    text = spec.strip().lower()
    if text == "all" or (text.isdigit() and int(text) >= 1):
        return True
    parts = [part.strip() for part in text.split(",")]
    return "," in text and all(part.isdigit() for part in parts) and len(set(map(int, parts))) == len(parts)


def _check_nodes(training: Any) -> None:
    _require(training.nodes >= 1, "training.nodes", f"must be at least 1, got {training.nodes}")
    _require(
        0 <= training.node_rank < training.nodes,
        "training.node_rank",
        f"must be 0 to {training.nodes - 1} for {training.nodes} node(s), got {training.node_rank}",
    )
    _require(training.rendezvous_timeout > 0, "training.rendezvous_timeout", "must be positive")
    _require(training.node_timeout > 0, "training.node_timeout", "must be positive")
    if training.nodes > 1:
        host, _, port = training.rendezvous.rpartition(":")
        _require(
            bool(host) and port.isdigit() and 0 < int(port) < 65536,
            "training.rendezvous",
            f"must be HOST:PORT (node 0's address and a free port) for {training.nodes} nodes, "
            f"got {training.rendezvous!r}",
        )


@dataclass
class ModelConfig:
    """Which base model to fine-tune and how to load it."""

    name: str = setting(
        DEMO_MODEL,
        "base model: 'demo', a local folder, a Hugging Face hub id, or a GGUF model (a .gguf file, "
        "ollama:NAME[:TAG] from Ollama's store, lmstudio:PUBLISHER/REPO[/FILE.gguf]; converted once)",
        flag="--model",
    )
    qlora: bool = setting(False, "load the base model in 4-bit NF4 (QLoRA) to save memory", flag="--qlora")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "compute dtype; auto picks bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU"
    )
    revision: str | None = setting(None, "hub revision (branch, tag or commit) of a hub model")
    trust_remote_code: bool = setting(
        False, "run the model repository's own Python code (only for models you trust)", flag="--trust-remote-code"
    )
    allow_pickle_weights: bool = setting(
        False,
        "also load pickle-based .bin/.pt weights when a model has no safetensors (unpickling can run code)",
        flag="--allow-pickle-weights",
    )
    adapter: str | None = setting(
        None,
        "start from an earlier run's LoRA adapter: a run folder, a run id or name, or a PEFT adapter folder "
        "(its rank, alpha and target modules replace the lora settings)",
        flag="--adapter",
    )

    def __post_init__(self) -> None:
        _require(bool(self.name and self.name.strip()), "model.name", "must name a model")


@dataclass
class DataConfig:
    """Where the examples come from and how they become packed token rows."""

    path: str = setting("", "dataset: a .jsonl/.json/.csv/.parquet file or a saved dataset folder", flag="--data")
    format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference"] = setting(
        "auto", "row format; auto detects it from the columns", flag="--data-format"
    )
    train_on_all_tokens: bool = setting(
        False, "compute the loss on every token, not only on assistant/completion tokens"
    )
    max_seq_len: int = setting(
        0,
        "longest example in tokens; longer ones are truncated or dropped (0: automatic: 2048 on a GPU; on a CPU the "
        "longest example rounded up, within what the CPU trains in seconds)",
    )
    overlong: Literal["truncate", "drop"] = setting("truncate", "what to do with examples over max_seq_len")
    tokens_per_batch: int = setting(
        0,
        "token budget of one packed row (one micro-batch) (0: automatic: 4096 on a GPU; on a CPU what it trains in "
        "about 2 s a step for the model)",
    )
    eval_fraction: float | None = setting(
        None,
        "share of examples held out for evaluation (0 disables eval; automatic: about 12 percent, at least 8 and at "
        "most 200 examples, none from a set under 16)",
    )
    eval_path: str | None = setting(None, "separate evaluation file (overrides eval_fraction)")

    def __post_init__(self) -> None:
        _require(
            self.max_seq_len == 0 or self.max_seq_len >= 8,
            "data.max_seq_len",
            f"must be at least 8 (or 0: automatic), got {self.max_seq_len}",
        )
        _require(self.tokens_per_batch >= 0, "data.tokens_per_batch", f"must be >= 0, got {self.tokens_per_batch}")
        if self.max_seq_len and self.tokens_per_batch and self.tokens_per_batch < self.max_seq_len:
            raise ConfigError(
                f"data.tokens_per_batch: must be at least max_seq_len ({self.max_seq_len}), "
                f"got {self.tokens_per_batch}",
                hint=f"tokens_per_batch {self.max_seq_len} or more would work (--tokens-per-batch "
                f"{self.max_seq_len}), or max_seq_len {self.tokens_per_batch} or less (--max-seq-len "
                f"{self.tokens_per_batch}); one left at 0 (automatic) follows the other",
            )
        _require(
            self.eval_fraction is None or 0.0 <= self.eval_fraction < 1.0,
            "data.eval_fraction",
            f"must be in [0, 1), got {self.eval_fraction}",
        )


@dataclass
class LoraConfig:
    """The low-rank adapter that is trained on top of the frozen base model."""

    rank: int = setting(
        0,
        "LoRA rank r (0: automatic: 8 for sets under 300 examples, 16 above, 32 for large sets of large models)",
        flag="--lora-rank",
    )
    alpha: float = setting(
        0.0,
        "LoRA scaling alpha: the update is scaled by alpha / rank (0: automatic: twice the rank)",
        flag="--lora-alpha",
    )
    dropout: float = setting(0.0, "dropout on the LoRA input", flag="--lora-dropout")
    target_modules: list[str] = setting(  # noqa: RUF009 - setting() returns a dataclass field
        ["all-linear"], "module names to adapt; 'all-linear' adapts every linear layer but the output head"
    )

    def sized(self) -> LoraConfig:
        """This adapter with a rank and alpha to build: an automatic rank (0) not yet fitted to the data takes 16,
        an automatic alpha twice the rank."""
        rank = self.rank or 16
        return dataclasses.replace(self, rank=rank, alpha=self.alpha or 2.0 * rank)

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "lora.rank", f"must be at least 1 (or 0: automatic), got {self.rank}")
        _require(self.alpha >= 0, "lora.alpha", f"must be positive (or 0: automatic), got {self.alpha}")
        _require(0.0 <= self.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        _require(bool(self.target_modules), "lora.target_modules", "must name at least one module")


@dataclass
class TrainingConfig:
    """The optimisation loop."""

    method: Literal["sft", "dpo", "grpo"] = setting(
        "sft",
        "sft: learn the answers of the examples; dpo: learn to prefer the chosen answer of each pair over the "
        "rejected one (direct preference optimization; needs prompt/chosen/rejected data); grpo: learn from rewards "
        "that score answers the model samples itself (group relative policy optimization; needs prompts and --reward)",
        flag="--method",
    )
    max_steps: int = setting(
        0,
        "optimizer steps to run (0: `epochs` passes over the data, or automatic when epochs is 0 too: several "
        "passes over a small set, one over a large one, 30 to 3,000 steps)",
        flag="--max-steps",
    )
    epochs: float = setting(0.0, "passes over the training data when max_steps is 0 (0: automatic)", flag="--epochs")
    learning_rate: float = setting(
        0.0,
        "peak learning rate of AdamW (0: automatic by model size: 3e-4 under 1B parameters, 2e-4 to 15B, 1e-4 above; "
        "a quarter of that for DPO)",
        flag="--lr",
    )
    weight_decay: float = setting(0.0, "AdamW weight decay")
    optimizer: Literal["auto", "fused", "foreach"] = setting(
        "auto",
        "AdamW implementation: fused (one kernel per step; automatic on an NVIDIA GPU) or foreach (elsewhere)",
        flag="--adamw",
    )
    step_readout: Literal["auto", "late", "immediate"] = setting(
        "auto",
        "when the host reads each step's loss and gradient norm: late (one step behind, so the GPU never waits for "
        "the host; automatic with the fused AdamW in a one-process run) or immediate (before the update)",
        flag="--step-readout",
    )
    warmup_steps: int | None = setting(
        None, "linear warm-up steps before the decay (automatic: 5 percent of the steps)"
    )
    schedule: Literal["cosine", "linear", "constant"] = setting("cosine", "learning-rate decay after warm-up")
    grad_accum: int = setting(1, "micro-batches accumulated into one optimizer step", flag="--grad-accum")
    max_grad_norm: float = setting(1.0, "gradient clipping norm (0 disables clipping)")
    eval_every: int | None = setting(
        None, "evaluate every N steps (0: only at the end; automatic: about 15 times a run when examples are held out)"
    )
    save_every: int = setting(50, "write a resumable checkpoint every N steps (0: only at the end)")
    early_stop: int | None = setting(
        None,
        "end the run after N evaluations in a row without a lower held-out loss (0: off; automatic: 4 where examples "
        "are held out); needs held-out data and eval_every; the best adapter is kept either way",
        flag="--early-stop",
    )
    keep_knowledge: bool | None = setting(
        None,
        "mix the base model's own answers to general prompts into the training rows (self-distillation replay), so "
        "the tuned model keeps what it knew while it learns the task (automatic: on for sets under 2,000 examples "
        "of an instruction-tuned model)",
        flag="--keep-knowledge",
    )
    knowledge_share: float | None = setting(
        None,
        "with keep_knowledge: the base model's answers mixed in per training example (automatic: 0.5; 1.0 mixes in "
        "as many as there are examples, at most 192)",
        flag="--knowledge-share",
    )
    knowledge_penalty: float | None = setting(
        None,
        "with keep_knowledge: the weight of a penalty on drifting from the base model's answers to general prompts "
        "(the KL divergence over their tokens, a few prompts each step; 0: off; automatic: 1.0 where knowledge is "
        "kept, on one GPU or the CPU)",
        flag="--knowledge-penalty",
    )
    seed: int = setting(42, "seed for data order, held-out split, LoRA init and dropout", flag="--seed")
    device: str = setting("auto", "'auto', 'cpu', 'cuda' or 'cuda:N'", flag="--device")
    max_bad_steps: int = setting(
        5, "stop the run after this many steps in a row with a non-finite loss or gradient (each is skipped)"
    )
    gpus: str = setting(
        "1",
        "GPUs to train on: a count, 'all', or a comma list of GPU indices; more than one runs under torchrun, "
        "one process per GPU (grad_accum stays the rows of one step over all GPUs; tokens_per_batch is per GPU)",
        flag="--gpus",
    )
    parallel: Literal["auto", "ddp", "fsdp"] = setting(
        "auto",
        "how several GPUs share the model: DDP keeps a copy on each, FSDP2 shards the base weights "
        "(auto: DDP unless the model does not fit one card)",
        flag="--parallel",
    )
    nodes: int = setting(
        1,
        "computers the run spans; more than one joins them through torchrun's rendezvous at --rendezvous, each "
        "with its own --node-rank (node 0 keeps the run folder; grad_accum stays the rows of one step over all)",
        flag="--nodes",
    )
    node_rank: int = setting(0, "this computer's place among the nodes: 0 keeps the run folder", flag="--node-rank")
    rendezvous: str = setting(
        "", "HOST:PORT where the nodes meet: node 0's address and a free port open in its firewall", flag="--rendezvous"
    )
    rendezvous_timeout: float = setting(
        120.0, "seconds to wait for every node to join before the run fails with a hint", flag="--rendezvous-timeout"
    )
    node_timeout: float = setting(
        30.0, "seconds without a sign of life from another node before every node stops", flag="--node-timeout"
    )

    rewards: tuple[RewardSpec, ...] = setting(
        (),
        "GRPO: a reward that scores each sampled answer, [WEIGHT*]KIND[:ARGUMENT]: 'regex:^\\d+$', reference "
        "(equals the row's answer), reference:contains, 'json:keys=name,age', length:20-200, python:FILE (a "
        "reward(prompt, completion, **row) function); repeat for several",
        flag="--reward",
    )
    group_size: int = setting(
        8, "GRPO: answers sampled for each prompt, whose rewards are compared within the group (TRL's "
        "num_generations)", flag="--group-size",
    )  # fmt: skip
    temperature: float = setting(1.0, "GRPO: sampling temperature of the answers", flag="--temperature")
    top_p: float = setting(1.0, "GRPO: nucleus sampling share of the answers (1: off)", flag="--top-p")
    max_new_tokens: int = setting(
        256, "GRPO: most tokens a sampled answer has; longer ones are cut (TRL's max_completion_length; TRL's "
        "default is 512)", flag="--max-new-tokens",
    )  # fmt: skip
    kl_beta: float = setting(
        0.0, "GRPO: weight of the KL penalty that holds the model near the base model (the adapter switched off; "
        "0: none, TRL's default)", flag="--beta",
    )  # fmt: skip
    loss_type: Literal["dapo", "grpo", "bnpo", "dr_grpo"] = setting(
        "dapo", "GRPO: how token losses are averaged, as TRL names them: dapo (all tokens of the step; TRL's "
        "default), grpo (each answer's tokens, then the answers), bnpo (all tokens), dr_grpo (tokens over answers × "
        "max new tokens)", flag="--loss-type",
    )  # fmt: skip
    epsilon: float = setting(0.2, "GRPO: clipping range of the probability ratio (TRL's default)", flag="--epsilon")
    epsilon_high: float | None = setting(
        None, "GRPO: upper clipping range, where it differs from epsilon (DAPO suggests 0.28; automatic: epsilon)"
    )
    scale_rewards: Literal["group", "batch", "none"] = setting(
        "group", "GRPO: divide advantages by the standard deviation of the group's rewards, the step's, or not at all"
    )
    num_iterations: int = setting(
        1, "GRPO: optimizer steps taken on each sampled group (TRL's num_iterations; above 1 the clipping acts)"
    )
    importance_sampling_level: Literal["token", "sequence"] = setting(
        "token", "GRPO: probability ratio per token, or one per answer (GSPO)"
    )
    mask_truncated_completions: bool = setting(
        False, "GRPO: answers cut at max new tokens teach nothing (their tokens leave the loss)"
    )

    def __post_init__(self) -> None:
        self._check_grpo()
        _check_nodes(self)
        _require(self.max_bad_steps >= 1, "training.max_bad_steps", f"must be at least 1, got {self.max_bad_steps}")
        _require(_gpus_spec_ok(self.gpus), "training.gpus", f"must be a count, 'all' or GPU indices, got {self.gpus!r}")
        _require(self.max_steps >= 0, "training.max_steps", f"must be >= 0, got {self.max_steps}")
        _require(self.epochs >= 0, "training.epochs", f"must be positive (or 0: automatic), got {self.epochs}")
        _require(
            self.learning_rate >= 0,
            "training.learning_rate",
            f"must be positive (or 0: automatic), got {self.learning_rate}",
        )
        _require(
            self.warmup_steps is None or self.warmup_steps >= 0,
            "training.warmup_steps",
            f"must be >= 0, got {self.warmup_steps}",
        )
        _require(self.grad_accum >= 1, "training.grad_accum", f"must be at least 1, got {self.grad_accum}")
        _require(self.max_grad_norm >= 0, "training.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _require(
            self.eval_every is None or self.eval_every >= 0,
            "training.eval_every",
            f"must be >= 0, got {self.eval_every}",
        )
        _require(self.save_every >= 0, "training.save_every", f"must be >= 0, got {self.save_every}")
        _require(
            self.early_stop is None or self.early_stop >= 0,
            "training.early_stop",
            f"must be >= 0, got {self.early_stop}",
        )
        if self.early_stop and self.eval_every == 0:
            raise ConfigError(
                "training.early_stop: counts evaluations during the run, and eval_every is 0 (only at the end)",
                hint="evaluate every few steps (--eval-every N), or leave --early-stop at 0",
            )
        _require(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "training.device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )

    def _check_grpo(self) -> None:
        if self.method == "grpo" and not self.rewards:
            raise ConfigError(
                "training.rewards: --method grpo needs at least one reward to score the sampled answers",
                hint="add --reward, e.g. --reward reference (the row's 'answer' column) or --reward 'regex:^\\d+$'",
            )
        _require(self.group_size >= 2, "training.group_size", f"must be at least 2, got {self.group_size}")
        _require(self.temperature > 0, "training.temperature", f"must be positive, got {self.temperature}")
        _require(0 < self.top_p <= 1, "training.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.max_new_tokens >= 1, "training.max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        _require(self.kl_beta >= 0, "training.kl_beta", f"must be >= 0, got {self.kl_beta}")
        _require(0 < self.epsilon < 1, "training.epsilon", f"must be in (0, 1), got {self.epsilon}")
        _require(
            self.epsilon_high is None or self.epsilon_high > 0,
            "training.epsilon_high",
            f"must be positive, got {self.epsilon_high}",
        )
        _require(self.num_iterations >= 1, "training.num_iterations", f"must be at least 1, got {self.num_iterations}")


@dataclass
class SpeedConfig:
    """The speed optimizations; each can be switched between two steps of a running job. None means automatic."""

    metadata_cache: bool | None = setting(
        None,
        "build packed-sequence metadata once per batch and hand it to every attention call",
        flag="--metadata-cache",
    )
    checkpointing: Literal["auto", "none", "standard", "offloaded"] = setting(
        "auto",
        "activation checkpointing: none, standard recompute, or offloaded to host memory (whose recompute skips "
        "frozen projections whose outputs nobody reads; exact)",
        flag="--checkpointing",
    )
    moe_routing: Literal["auto", "stock", "bincount", "sync-free"] = setting(
        "auto", "how MoE layers group tokens by expert", flag="--moe-routing"
    )
    attention_backend: Literal["auto", "cudnn", "varlen", "flash_attn", "flex", "sdpa"] = setting(
        "auto",
        "attention kernel when the metadata cache is on: auto picks the best kernel for packed rows "
        "(FlashAttention-2's varlen kernel on NVIDIA GPUs) and, on Hopper GPUs, cuDNN's fused causal kernel for a row "
        "that holds one document (1.6x FlashAttention-2's on the H200); cudnn runs such rows through cuDNN on any GPU; "
        "a named kernel serves every row",
        flag="--attention-backend",
    )
    fused_loss: bool | None = setting(
        None,
        "compute the loss and its gradient from the hidden states in chunks, never holding the full logits "
        "(automatic: on where the model's head allows it)",
        flag="--fused-loss",
    )
    chunked_mlp: bool | None = setting(
        None,
        "run the MLP, norms and projections over chunks of the sequence during checkpointed recompute "
        "(automatic: on for rows over 8,192 tokens under checkpointing when GPU memory is short; it costs time)",
        flag="--chunked-mlp",
    )
    host_embedding: bool | None = setting(
        None,
        "look the frozen input embedding up in host memory, so its table takes no GPU memory (automatic: on where "
        "the table would take over 8 percent of the GPU's memory)",
        flag="--host-embedding",
    )
    lora_16bit: bool | None = setting(
        None,
        "run the LoRA adapters in the model's 16-bit dtype with float32 master weights, instead of peft's float32 "
        "copies of every adapted input, with one LoRA A product for each group of projections that read the same "
        "input (q/k/v, gate/up) (automatic: on for bf16/fp16 models)",
        flag="--lora-16bit",
    )
    fused_kernels: bool | None = setting(
        None,
        "fuse each layer's norms, rotary, SwiGLU and LoRA paths with torch.compile (automatic: on for CUDA "
        "with triton, off on CPU)",
        flag="--fused-kernels",
    )
    dequant_once: bool | None = setting(
        None,
        "dequantize each 4-bit weight once per recompute and reuse it for its gradient (automatic: on under "
        "offloaded checkpointing when one layer's 16-bit weights fit easily)",
        flag="--dequant-once",
    )
    resident_layers: bool | None = setting(
        None,
        "under checkpointing, let as many layers as spare GPU memory holds keep their activations and skip the "
        "recompute (automatic: on for GPUs, sized by the memory planner; the same gradients, less time)",
        flag="--resident-layers",
    )
    fp8_base: Literal["auto", "off", "recompute", "all"] = setting(
        "auto",
        "multiply by the frozen base weights in fp8 (e4m3, per-row scales) on GPUs with fp8 tensor cores (RTX 40/50, "
        "Hopper, Blackwell, GB10), with about 4 percent rounding error per product against 0.2 percent in bf16: "
        "recompute (the forward pass and its loss stay 16-bit; fp8 in offloaded checkpointing's recompute and the "
        "input gradients: 20-step losses of 8B QLoRA within 2.4e-4 of bf16), all (every product: faster, 2.9e-3) "
        "or off (automatic: recompute for a dense model's 4-bit base under offloaded checkpointing, off elsewhere)",
        flag="--fp8-base",
    )
    step_graphs: bool | None = setting(
        None,
        "replay each micro-batch's forward and backward from a CUDA graph, so the host's Python and kernel launches "
        "no longer set the pace (rows are padded into a few shape buckets; one step's activations stay reserved "
        "between steps; automatic: on trial, kept only where a replayed micro-batch measures faster than an eager "
        "one)",
        flag="--step-graphs",
    )

    @classmethod
    def stock(cls, **changes: Any) -> SpeedConfig:
        """Stock transformers and peft: every switch off, step graphs included, none left automatic; then
        ``changes`` (e.g. ``checkpointing="standard"``, peft's documented recompute for QLoRA)."""
        off: dict[str, Any] = {f.name: False for f in dataclasses.fields(cls) if f.default is None}
        return cls(**{**off, "checkpointing": "none", "moe_routing": "stock", "fp8_base": "off", **changes})


@dataclass
class DpoConfig:
    """Preference tuning (``training.method`` dpo): the loss on each pair's chosen and rejected answers, and the
    reference model it measures them against.

    The reference is the model the run starts from, as in the DPO paper and TRL: with ``model.adapter`` that is the
    base model with the starting adapter on, otherwise the base model (a fresh adapter changes nothing). ``reference``
    "base" measures against the base model with the adapter switched off instead. The defaults are TRL's."""

    beta: float = setting(
        0.1,
        "how far the model may move from the reference: a smaller beta lets it drift further (TRL's default 0.1)",
        flag="--dpo-beta",
    )
    loss: Literal["sigmoid", "ipo", "hinge"] = setting(
        "sigmoid",
        "sigmoid: the DPO paper's loss; ipo: squared distance to a margin of 1/(2 beta) on per-token averages; "
        "hinge: the SLiC hinge on the reward margin",
        flag="--dpo-loss",
    )
    reference: Literal["start", "base"] = setting(
        "start",
        "start: the model the run starts from (with --adapter, that adapter; the DPO paper's and TRL's reference); "
        "base: the base model with the adapter switched off (the same as start without --adapter)",
        flag="--dpo-reference",
    )

    def __post_init__(self) -> None:
        _require(self.beta > 0, "dpo.beta", f"must be positive, got {self.beta}")


@dataclass
class VisionConfig:
    """Vision-language models (a model with a vision tower, engine.vision): how big its images may be and what LoRA
    adapts. A text model ignores this section."""

    max_pixels: int | None = setting(
        None,
        "images with more pixels than this are scaled down (aspect kept) before the processor sees them "
        "(default: the family's budget, e.g. 1024x28x28 for Qwen-VL)",
        flag="--max-pixels",
    )
    adapt_vision: bool = setting(
        False, "also put LoRA on the vision tower and its projector (frozen by default)", flag="--adapt-vision"
    )

    def __post_init__(self) -> None:
        if self.max_pixels is not None:
            _require(self.max_pixels >= 28 * 28, "vision.max_pixels", f"must be at least 784, got {self.max_pixels}")


@dataclass
class OutputConfig:
    """Where the run folder goes."""

    dir: str = setting("runs", "parent folder of run folders", flag="--output")
    name: str | None = setting(
        None,
        'run folder name, one folder inside the output folder: no / or \\, not . or .., none of <>:"|?*, no '
        "name Windows reserves (CON, NUL, COM1...), at most 120 characters (default: time, model and dataset)",
        flag="--name",
    )
    keep_checkpoints: int = setting(2, "how many recent checkpoints to keep")

    def __post_init__(self) -> None:
        _require(self.keep_checkpoints >= 1, "output.keep_checkpoints", "must be at least 1")
        if isinstance(self.name, str):
            problem = run_name_problem(self.name)
            _require(problem is None, "output.name", f"{self.name!r} {problem}")


@dataclass
class RunConfig:
    """Everything that defines a run; saved as ``config.json`` in its folder."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["training"]["rewards"] = [spec.to_json() for spec in self.training.rewards]
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Build a config from nested dicts; unknown sections or keys are errors, missing ones take defaults."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            raise ConfigError(f"unknown config section(s): {', '.join(unknown)}; known: {', '.join(sections)}")
        hints = get_type_hints(cls)
        built = {name: _section_from_dict(name, hints[name], raw.get(name, {})) for name in sections}
        return cls(**built)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as err:
            raise ConfigError(f"config file not found: {path}") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {path} is not valid JSON: {err}") from err
        except RecursionError as err:
            raise ConfigError(f"config file {path} is nested too deeply to be a TuneDeck config") from err
        except OSError as err:
            raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from err
        if _in_run_folder(Path(path)):
            raw = _without_refused_name(raw)
        try:
            return cls.from_dict(raw)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err.message}", err.hint) from err


RUN_FOLDER_SIGNS = ("metrics.jsonl", "checkpoints", ".tunedeck-run")
"""Entries beside a ``config.json`` that make it a run's saved config (engine.run.folder, engine.run.ownership)."""


def _in_run_folder(path: Path) -> bool:
    return path.name == "config.json" and any((path.parent / sign).exists() for sign in RUN_FOLDER_SIGNS)


def _without_refused_name(raw: Any) -> Any:
    """A saved run's config with a run name today's rule refuses dropped: runs from before names were checked
    (``--name exp/1`` made runs/exp/1) still resume, chat, export and seed new runs, which get a default name."""
    output = raw.get("output") if isinstance(raw, dict) else None
    name = output.get("name") if isinstance(output, dict) else None
    if not isinstance(name, str) or run_name_problem(name) is None:
        return raw
    return {**raw, "output": {**output, "name": None}}  # type: ignore[dict-item]


REMOVED_SPEED_SETTINGS = ("lora_groups", "lean_recompute", "four_bit_kernel", "keep_attention")
"""Speed settings of earlier versions whose work is now always part of another setting, or gone
(docs/speed_switch_gains.md): a saved ``config.json`` that names them still loads, without them."""


def upgrade_speed_section(raw: dict[str, Any]) -> dict[str, Any]:
    """An older ``speed`` section in today's keys: removed settings dropped, ``cudnn_attention`` folded into
    ``attention_backend`` and ``fp8_scope`` into ``fp8_base`` (a saved run resumes, lists and chats as before)."""
    speed = {key: value for key, value in raw.items() if key not in REMOVED_SPEED_SETTINGS}
    cudnn = speed.pop("cudnn_attention", None)
    if cudnn is True:
        speed["attention_backend"] = "cudnn"
    elif cudnn is False and speed.get("attention_backend", "auto") in ("auto", "cudnn"):
        speed["attention_backend"] = "varlen"  # one-document rows on the packed rows' kernel, as switched off
    scope = speed.pop("fp8_scope", None)
    fp8 = speed.get("fp8_base", "auto")
    if fp8 is None or fp8 is False or fp8 is True:
        speed["fp8_base"] = {None: "auto", False: "off", True: scope if scope == "recompute" else "all"}[fp8]
    return speed


def _section_from_dict(section: str, section_type: type, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"config section '{section}' must be an object, got {type(raw).__name__}")
    if section == "speed":
        raw = upgrade_speed_section(raw)
    hints = get_type_hints(section_type)
    names = {f.name for f in dataclasses.fields(section_type)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) in '{section}': {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    values = {key: coerce_value(f"{section}.{key}", hints[key], value) for key, value in raw.items()}
    return section_type(**values)


def coerce_value(name: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against a field's annotation, converting the safe cases (int -> float, str -> list)."""
    options = get_args(annotation)
    origin = getattr(annotation, "__origin__", None)
    if origin is Literal:
        if value not in options:
            raise ConfigError(f"{name}: must be one of {', '.join(map(str, options))}, got {value!r}")
        return value
    if type(None) in options:  # Optional[X]
        if value is None:
            return None
        inner = [opt for opt in options if opt is not type(None)]
        return coerce_value(name, inner[0], value)
    if origin is tuple:
        return _reward_specs(name, value)
    if origin is list:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: must be a list of strings, got {value!r}")
        return value
    return _coerce_scalar(name, annotation, value)


def _reward_specs(name: str, value: Any) -> tuple[RewardSpec, ...]:
    """Rewards as config.json keeps them (objects), as ``--reward`` gives them (text) or as built."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{name}: must be a list of rewards, got {value!r}")
    specs = []
    for item in value:
        if isinstance(item, RewardSpec):
            specs.append(item)
        elif isinstance(item, str):
            specs.append(parse_reward_flag(item))
        elif isinstance(item, dict):
            specs.append(RewardSpec.from_json(item))
        else:
            raise ConfigError(f"{name}: a reward must be an object or --reward text, got {item!r}")
    return tuple(specs)


def _coerce_scalar(name: str, annotation: Any, value: Any) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: must be an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            return float(value)
        raise ConfigError(f"{name}: must be a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name}: must be a string, got {value!r}")
    return value


def flag_name(spec: dataclasses.Field[Any]) -> str:
    """The flag ``--help`` shows for a setting: its field name in kebab-case unless the config names another."""
    return spec.metadata.get("flag") or "--" + spec.name.replace("_", "-")


def flag_options(spec: dataclasses.Field[Any], annotation: Any, default: Any) -> dict[str, Any]:
    """A setting's flag declaration as argparse keyword arguments: on/off for a bool (automatic where it may be None),
    its choices for a Literal, else a value; the help text is the field's, with its default. Every command that takes
    a setting declares it from here (``tunedeck train``, ``tunedeck plan``)."""
    kwargs: dict[str, Any] = {}
    help_text = spec.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
    options = get_args(annotation)
    if annotation is bool or (bool in options and type(None) in options):
        kwargs["action"] = argparse.BooleanOptionalAction
        shown = "auto" if default is None else ("on" if default else "off")
        kwargs["help"] = f"{help_text} (default: {shown})"
    elif getattr(annotation, "__origin__", None) is tuple:
        kwargs["action"] = "append"
        kwargs["metavar"] = "SPEC"
        kwargs["help"] = f"{help_text} (default: none)"
    elif getattr(annotation, "__origin__", None) is Literal:
        kwargs["choices"] = options
        kwargs["help"] = f"{help_text} (default: {default})"
    else:
        kwargs["metavar"] = spec.name.upper()
        kwargs["help"] = f"{help_text} (default: {default})"
    return kwargs


def setting_flag(section: str, name: str) -> tuple[str, dict[str, Any]]:
    """The flag and argparse keyword arguments of setting ``section.name`` (e.g. ``speed.checkpointing``)."""
    holder = getattr(RunConfig(), section)
    spec = next(spec for spec in dataclasses.fields(holder) if spec.name == name)
    annotation = get_type_hints(type(holder))[name]
    return flag_name(spec), flag_options(spec, annotation, getattr(holder, name))
