"""Each micro-batch's forward and backward replayed from one CUDA graph: no Python, no launches on the host.

Why: on a 4-bit 8B model at 4,096 tokens the host needs about as long to queue a step as the GPU needs to run
it (H200: 393 of 410 ms; benchmarks/qlora_h200.md). Each step launches thousands of kernels: 264 compiled-region
calls with their guard checks, bitsandbytes' Python-side dequantize ops, 2,400 matmuls and the pinned copies of
offloaded checkpointing. Captured once, a whole micro-step replays as a single graph launch, so the step runs at
the GPU's pace, and the GPU-side savings of other switches (fp8 products) turn into time.

How: a CUDA graph replays fixed work on fixed memory, so a micro-batch must look exactly like the one captured.
Packed rows differ in length, document count and trained tokens, so each row is padded into a bucket first:
* its length is rounded up to an eighth of the longest row seen so far (at most 12.5% padding; a dataset packed
  to one row length pads nothing). The padding tokens join the last document and learn nothing: causal attention
  never lets an earlier token see them, so the real tokens' outputs, loss and gradients are unchanged;
* its document count is rounded up to a power of two with empty documents (a row of one document stays one, so
  it keeps the whole-row causal kernel), and the longest document is declared as the whole row;
* its trained positions are rounded up to a quarter of the row with positions whose label is ignored.
The loss divisor (trained tokens of the whole step) becomes a device tensor instead of a constant.
The first micro-batch of a bucket runs eagerly (it compiles, autotunes and allocates host buffers), the second is
captured and replayed, later ones only replay after their inputs are copied into the captured ones. Gradients
accumulate into fixed gradient tensors that stay bound to the parameters: between steps the speed controller
clears them in place (one kernel), and a micro-step binds them again if anything else replaced them. All graphs
share one memory pool; a switch change drops them.

Automatic, on trial (:class:`Trial`): where graphs can run, the first bucket runs eagerly twice (the first run
compiles, the second is timed), is captured, and its second replay is timed too, each from its start to the next
micro-batch's; the graphs stay unless the replay took clearly longer than the eager run (:data:`TRIAL_KEEP`: a near-tie
keeps them), and the run reports what it measured either way. A fast GPU on a model whose step launches thousands of
kernels is host-bound, and replays much faster (H200, Llama-3.1-8B in 4-bit, 4,096 tokens under an 8 GiB cap:
353-370 ms against 407-466 ms eagerly, benchmarks/qlora_automatic_graphs_h200.md and
benchmarks/history/qlora_rerun_h200.md); a card that spends longer in its kernels gains nothing from them, and where
the padded replay measures slower it keeps its memory and unpadded rows instead. Those H200 figures timed each
micro-batch only to its own end. The Qwen3-8B row then measured 373 against 381 ms and kept graphs off, although its
host took 442 ms of a 448 ms eager step (benchmarks/history/qlora_rerun_h200.md); counting the time to the next
micro-batch takes in the host work between them, which a replay lets overlap the GPU's.

Where it runs: CUDA, one process (no DDP/FSDP hooks), no float16 loss scaling, no dropout (a recompute inside a
graph cannot replay random masks). A step that waits for the GPU (MoE routing that reads expert counts on the
host) or runs out of memory cannot be captured: the switch then turns itself off with the reason and the
micro-batch runs eagerly, so nothing is lost. Memory: the pool keeps one step's activations reserved between
steps, where the optimizer can no longer reuse them (H200, Llama-3.1-8B in 4-bit, 4,096 tokens under an 8 GiB cap:
7.82 GiB reserved against 7.50 GiB eagerly; the 16,384-token row under that cap ran out of memory beside its
graphs). So automatic graphs stay off where the row needs its MLPs chunked to fit (:data:`MEMORY_BOUND`): there
memory, not the host, limits the run, and the GPU's long kernels leave the host little to save anyway.
Dropping graphs waits for the replays still queued (:func:`wait_for_replays`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from engine.data.packing import IGNORE_INDEX, PackedBatch
from engine.speed.offloaded_checkpoint import with_index

__all__ = [
    "Bucket",
    "CudaGraphCapture",
    "StepGraphs",
    "bucket_of",
    "flatten",
    "pad_to",
    "resolve",
    "unsupported_reason",
    "wait_for_replays",
]

_T = TypeVar("_T")

ROW_STEP_SHARE = 8
"""Row lengths are rounded up to 1/ROW_STEP_SHARE of the longest row seen."""
ROW_STEP_MIN = 256
POSITION_SHARE = 4
"""Trained positions are rounded up to 1/POSITION_SHARE of the padded row."""
MAX_GRAPHS = 8
"""Buckets that keep a graph; micro-batches of further buckets run eagerly."""
EAGER_RUNS = 1
"""Eager micro-batches of a bucket before it is captured (compiling, autotuning, host buffers)."""
TRIAL_KEEP = 1.02
"""Automatic step graphs stay on where a replayed micro-batch takes at most this share of the time the same
micro-batch took eagerly: a tie, or a replay up to 2% slower, keeps them. A replay's time is what every replay
takes, while one eager micro-batch is the eager path's best case, since anything else the host does (the app's
window, garbage collection, another program) only slows it. On the H200 (Llama-3.1-8B in 4-bit, 4,096 tokens,
8 GiB cap) one trial measured 359 ms replayed against 363 ms eagerly and, at 97%, turned the graphs off; that run's
eager steps then took 360-630 ms (median 463 ms) against a steady 365-385 ms with graphs kept in an otherwise
identical run (benchmarks/history/qlora_train_h200.md). Another measured 367 against 366 ms and turned them off; its
eager steps then took 378-449 ms (median 401 ms) where the same process had run 371-373 ms with graphs
(benchmarks/qlora_moe_resident_h200.md). Where the GPU sets the pace, keeping them on such a near-tie costs at most
those 2%."""
MEMORY_BOUND = (
    "automatic: off; the row needs its MLPs chunked to fit in memory, and graphs would keep one step's activations "
    "reserved beside it"
)
"""Why automatic step graphs stay off where memory, not the host, limits the run (a long row under a small cap)."""


@dataclass(frozen=True)
class Bucket:
    """The padded shape of a micro-batch: row length, documents and trained positions."""

    tokens: int
    documents: int
    positions: int


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def bucket_of(batch: PackedBatch, longest: int) -> Bucket:
    """The bucket a row pads into, given the longest row seen so far (this one included)."""
    step = max(ROW_STEP_MIN, _round_up(-(-longest // ROW_STEP_SHARE), 128))
    tokens = _round_up(batch.num_tokens, step)
    documents = 1 if batch.num_documents == 1 else 1 << (batch.num_documents - 1).bit_length()
    trained = batch.loss_positions.numel() if batch.loss_positions is not None else tokens
    positions = min(tokens, _round_up(max(trained, 1), -(-tokens // POSITION_SHARE)))
    return Bucket(tokens, documents, positions)


def _tail(like: torch.Tensor, count: int, value: int) -> torch.Tensor:
    return torch.full((*like.shape[:-1], count), value, dtype=like.dtype, device=like.device)


def pad_to(batch: PackedBatch, bucket: Bucket) -> PackedBatch:
    """The row padded into ``bucket``: the same loss and gradients, a shape that repeats.

    Padding tokens (id 0, labels ignored) extend the last document, whose positions they continue; empty documents
    fill the document count; ignored positions (the row's last, which predicts nothing) fill the trained ones."""
    extra = bucket.tokens - batch.num_tokens
    if extra < 0 or bucket.documents < batch.num_documents:
        raise ValueError(f"a row of {batch.num_tokens} tokens and {batch.num_documents} documents exceeds {bucket}")
    last = batch.doc_lengths[-1]
    lengths = (*batch.doc_lengths[:-1], last + extra) + (0,) * (bucket.documents - batch.num_documents)
    cumulative = [0]
    for n in lengths:
        cumulative.append(cumulative[-1] + n)
    positions = batch.loss_positions
    if positions is not None:
        if positions.numel() > bucket.positions:
            raise ValueError(f"{positions.numel()} trained positions exceed {bucket}")
        positions = torch.cat([positions, _tail(positions, bucket.positions - positions.numel(), bucket.tokens - 1)])
    ids = batch.input_ids
    continued = torch.arange(last, last + extra, dtype=batch.position_ids.dtype, device=batch.position_ids.device)
    host_ids = batch.host_input_ids
    return dataclasses.replace(
        batch,
        input_ids=torch.cat([ids, _tail(ids, extra, 0)], dim=-1),
        labels=torch.cat([batch.labels, _tail(batch.labels, extra, IGNORE_INDEX)], dim=-1),
        position_ids=torch.cat([batch.position_ids, continued.expand(*batch.position_ids.shape[:-1], extra)], dim=-1),
        document_ids=torch.cat([batch.document_ids, _tail(batch.document_ids, extra, batch.num_documents - 1)], dim=-1),
        cu_seqlens=torch.tensor(cumulative, dtype=batch.cu_seqlens.dtype, device=batch.cu_seqlens.device),
        max_seqlen=bucket.tokens,  # an upper bound is all varlen kernels need
        doc_lengths=lengths,
        loss_positions=positions,
        host_input_ids=None if host_ids is None else torch.cat([host_ids, _tail(host_ids, extra, 0)], dim=-1),
    )


# --- inputs as static buffers -----------------------------------------------------------------------------------


def flatten(tree: Any, device: torch.device) -> tuple[list[torch.Tensor], tuple[Any, ...]] | None:
    """(the tensors on ``device`` in a fixed order, a key of everything else) of a micro-batch's inputs, or None
    when something in them cannot be a graph input (an object of unknown kind) or none of them is on ``device``.

    Dicts, lists, tuples and dataclasses are walked; tensors on ``device`` become graph inputs (their shape, dtype
    and strides go into the key); numbers, strings, dtypes and None go into the key as they are. Tensors elsewhere
    (host copies kept for host-side work) are left out: the graphed work never reads them."""
    leaves: list[torch.Tensor] = []
    key: list[Any] = []

    def walk(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            if value.device == device:
                leaves.append(value)
                key.append(("tensor", tuple(value.shape), value.stride(), value.dtype, value.requires_grad))
            else:
                key.append("elsewhere")
            return True
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            key.append(value)
            return True
        if isinstance(value, dict):
            key.append(("dict", tuple(value)))
            return all(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            key.append((type(value).__name__, len(value)))
            return all(walk(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            key.append(type(value).__qualname__)
            return all(walk(getattr(value, f.name)) for f in dataclasses.fields(value))
        return False

    return (leaves, tuple(key)) if walk(tree) and leaves else None


# --- capture and replay -----------------------------------------------------------------------------------------


class GpuInterval:
    """GPU time between :meth:`start` and :meth:`stop` on the current stream, read without a host sync once the GPU
    has passed the stop (:meth:`done`)."""

    def __init__(self) -> None:
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.begin.record()

    def stop(self) -> None:
        self.end.record()

    def done(self) -> bool:
        return bool(self.end.query())

    def ms(self) -> float:
        return float(self.begin.elapsed_time(self.end))


@dataclass
class Trial:
    """Automatic step graphs: one bucket's eager micro-batch (after the one that compiles) timed against its second
    replay (after the one that uploads the graph), the graphs kept unless they are slower.

    Each is timed on the GPU from its start to the start of the micro-batch after it, so the time counts what the
    host does between them too (the optimizer step, the next batch's inputs). Where the host sets the pace (a fast
    GPU: the H200 on an 8B 4-bit model), the GPU waits for it inside an eager micro-batch and again between them; a
    replay is queued at once, and the host's work between micro-batches then overlaps the GPU's. Where the GPU sets
    the pace (a consumer card on the same model) both take about as long, and the graphs' padding and reserved
    memory buy nothing."""

    timer: Callable[[], Any]
    key: tuple[Any, ...] | None = None
    eager: Any = None
    replay: Any = None
    replays: int = 0
    running: Any = None
    """The interval of the timed micro-batch, until the next one starts."""

    def next_micro_batch(self) -> None:
        """A micro-batch starts: the timed one before it, if any, ends here."""
        if self.running is not None:
            self.running.stop()
            self.running = None

    def timed(self, key: tuple[Any, ...], phase: str, run: Callable[[], _T]) -> _T:
        """``run()``, timed when it is the trial's eager run or its second replay of the trial's bucket."""
        if phase == "eager":
            due = self.eager is None
        else:
            self.replays += key == self.key
            due = key == self.key and self.replays == 2
        if not due:
            return run()
        interval = self.timer()
        interval.start()
        out = run()
        self.running = interval
        if phase == "eager":
            self.key, self.eager = key, interval
        else:
            self.replay = interval
        return out

    def times_ms(self) -> tuple[float, float]:
        """(eager, replayed) GPU milliseconds, once :meth:`verdict` has one."""
        return self.eager.ms(), self.replay.ms()

    def verdict(self) -> tuple[bool, str] | None:
        """(keep, reason) once both runs are timed to the next micro-batch and done on the GPU; None before."""
        if self.eager is None or self.replay is None or self.running is not None or not self.replay.done():
            return None
        eager, replay = self.eager.ms(), self.replay.ms()
        measured = (
            f"a replayed micro-batch took {replay:,.0f} ms from its start to the next one's, against {eager:,.0f} ms "
            "run eagerly"
        )
        if replay <= TRIAL_KEEP * eager:
            return True, f"automatic: on; {measured}"
        return False, f"automatic: off; {measured}: the GPU, not the host, sets the pace here"


@dataclass(eq=False)
class _Captured:
    replay: Callable[[], None]
    inputs: list[torch.Tensor]
    loss: torch.Tensor


class CudaGraphCapture:
    """Captures functions as CUDA graphs that share one memory pool (they never run at the same time).

    Captures run on a stream of their own. A capture that fails (out of memory, a host sync) is ended and thrown
    away, and the caller's stream is current again, so the eager work that follows allocates as before."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None

    def __call__(self, function: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """(replay, output) of ``function`` captured as a graph; nothing runs until the first replay."""
        if self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        assert self.stream is not None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the pool takes what the eager micro-batches left cached
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                out = function()
                graph.capture_end()  # fails too when the function left work on another stream unjoined
            except BaseException:
                _abandon(graph, self.pool)
                raise
        caller.wait_stream(self.stream)
        return graph.replay, out


def wait_for_replays(device: torch.device) -> None:
    """Wait until the GPU has run everything queued, replays included, before graphs and their pool are dropped.

    Giving the pool's memory back unmaps it, and the allocator waits only for the stream the pool was captured on,
    not for the one replays run on: a replay still queued (the host runs a step ahead) could then touch unmapped
    memory, an illegal memory access. Dropping graphs is rare (a switch change, a trial that keeps them off, a
    shortage), so this one sync costs nothing per step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cublas_workspaces(device: torch.device) -> None:
    """Let cuBLAS drop its cached workspaces, once the graphs that used them are gone.

    cuBLAS keeps one workspace per stream, taken from the allocator the first time a product runs there; a
    capture's comes from the graphs' private pool. Kept in cuBLAS's cache, it held that pool's memory after the
    graphs were dropped (64 MiB per capture stream on the H200, GPU test). The next product takes a fresh one."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device.type == "cuda" and clear is not None:
        clear()


def _abandon(graph: Any, pool: Any) -> None:
    """End a failed capture and give back the memory it took from the pool; the failure is the caller's to report.

    A capture that fails never reaches the end of ``capture_end``, where the allocator stops routing to the pool,
    so its blocks would stay reserved for good and the eager work after it would run short (measured on the H200:
    1.9 GiB of an 8 GiB cap). Each step below may fail once the capture is broken; the others still run."""
    device = torch.cuda.current_device()
    steps = (graph.capture_end, lambda: torch._C._cuda_endAllocateToPool(device, pool), graph.reset)
    for step in steps:
        with contextlib.suppress(Exception):  # the capture already failed: ending it reports that again
            step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@dataclass
class StepGraphs:
    """Captures and replays micro-steps per bucket for one model's trainable parameters."""

    device: torch.device
    parameters: Callable[[], list[torch.nn.Parameter]]
    reset: Callable[[], None] = lambda: None
    """Forgets host-side state of the step that a capture must not see (events recorded outside it)."""
    capturer: Callable[[], Callable[..., tuple[Callable[[], None], torch.Tensor]]] = CudaGraphCapture
    on: bool = False
    failure: str | None = None
    verdict: str | None = None
    """Why automatic step graphs stayed on, once their trial has timed them (:class:`Trial`)."""
    trial: Trial | None = None
    trial_result: tuple[bool, float, float] | None = None
    """The last trial's (keep, eager ms, replayed ms), kept for later runs (:mod:`engine.speed.reuse`)."""
    timer: Callable[[], Any] = GpuInterval
    wait: Callable[[torch.device], None] = wait_for_replays
    """Waits for replays still running on the GPU before their graphs and memory go (:func:`wait_for_replays`)."""
    longest: int = 0
    eager_runs: int = EAGER_RUNS
    max_graphs: int = MAX_GRAPHS
    replays: int = 0
    _seen: Counter[tuple[Any, ...]] = field(default_factory=Counter)
    _graphs: dict[tuple[Any, ...], _Captured] = field(default_factory=dict)
    _grads: list[torch.Tensor] = field(default_factory=list)
    _params: list[torch.nn.Parameter] | None = None
    """The trainable parameters, listed once per set of graphs (walking an 8B model's modules costs host time)."""
    _capture: Any = None

    def __post_init__(self) -> None:
        self.device = with_index(self.device)  # compared with the devices tensors name

    def switch(self, on: bool, trial: bool = False) -> None:
        """On or off, with no graphs and no earlier failure (a new choice of switches tries again). ``trial``
        (automatic): a replay is timed against an eager run first, and the graphs stay unless slower."""
        self.clear()
        self.on, self.failure, self.verdict = on, None, None
        self.trial = Trial(self.timer) if on and trial else None
        self.eager_runs = EAGER_RUNS + (self.trial is not None)  # the first eager run compiles; the next is timed

    def clear(self) -> None:
        """Drop every graph and its memory (after a switch change: the captured work would be stale)."""
        held = bool(self._graphs)
        if held:
            self.wait(self.device)
        self._graphs.clear()
        self._seen.clear()
        self._grads = []
        self._params = None
        self._capture = None
        if not held:
            return
        self.reset()  # host-side state may still point into the pool (the offloader's prefetched layer inputs)
        release_cublas_workspaces(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the pool's memory goes back to the GPU now, not at the next shortage

    def give_up(self, reason: str) -> bool:
        """Turn the graphs off for this run with ``reason`` and free their memory; True when they held some."""
        held = bool(self._graphs)
        if held and self.failure is None:
            self.failure = f"off: {reason}"
        self.clear()
        return held

    @property
    def active(self) -> bool:
        """Switched on and not turned off by a failure: micro-batches are padded and replayed."""
        return self.on and self.failure is None

    @property
    def captured(self) -> int:
        return len(self._graphs)

    @property
    def holds_grads(self) -> bool:
        """Parameters' gradients are the graphs' fixed tensors: clear them in place, not to None (a micro-step
        would only bind them again, which costs host time at the start of every step)."""
        return self.active and bool(self._grads)

    def bucket(self, batch: PackedBatch) -> Bucket:
        self.longest = max(self.longest, batch.num_tokens)
        return bucket_of(batch, self.longest)

    def run(self, tree: Any, body: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``body(tree)`` (forward and backward of one micro-batch, returning its detached loss), replayed from a
        graph once the tree's bucket has run eagerly."""
        if self.trial is not None:
            self.trial.next_micro_batch()
        self._judge()
        flat = flatten(tree, self.device) if self.active else None
        if flat is None:
            return body(tree)
        leaves, key = flat
        captured = self._graphs.get(key)
        if captured is None:
            self._seen[key] += 1
            if self._seen[key] <= self.eager_runs or len(self._graphs) >= self.max_graphs:
                if self.trial is not None and self._seen[key] == self.eager_runs:
                    return self.trial.timed(key, "eager", lambda: body(tree))
                return body(tree)
            captured = self._captured(key, tree, leaves, body)
            if captured is None:
                return body(tree)
        else:
            self._bind_grads()
            torch._foreach_copy_(captured.inputs, leaves)
        if self.trial is not None:
            self.trial.timed(key, "replay", captured.replay)
        else:
            captured.replay()
        self.replays += 1
        return captured.loss.clone()

    def _judge(self) -> None:
        """End the trial once it is timed: keep the graphs with the measured reason, or drop them and their memory."""
        verdict = self.trial.verdict() if self.trial is not None else None
        if verdict is None:
            return
        keep, reason = verdict
        assert self.trial is not None  # a verdict comes from a trial
        self.trial_result = (keep, *self.trial.times_ms())
        self.trial = None
        if keep:
            self.verdict = reason
        else:
            self.clear()
            self.failure = reason

    def _captured(self, key: tuple[Any, ...], tree: Any, leaves: list[torch.Tensor], body: Callable[[Any], torch.Tensor]
                  ) -> _Captured | None:  # fmt: skip
        self._bind_grads()
        if self._capture is None:
            self._capture = self.capturer()
        self.reset()
        failure = None
        try:
            replay, loss = self._capture(lambda: body(tree))
        except Exception as err:  # any capture failure falls back to eager, with its reason
            failure = f"off: this step cannot run as a CUDA graph ({type(err).__name__}: {_first_line(err)})"
        if failure is not None:  # the exception is gone, and with its frames the tensors the capture allocated
            self.failure = failure
            self.clear()
            self.reset()
            gc.collect()  # frames of the failed capture that refer to each other, and the pool tensors they hold
            self.wait(self.device)  # the pool's memory is unmapped next: nothing queued may still use it
            release_cublas_workspaces(self.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # their pool's blocks go back now: the eager run after this needs them
            return None
        self.reset()
        captured = _Captured(replay, leaves, loss)
        self._graphs[key] = captured
        return captured

    def zero_grads(self) -> None:
        """Zero the fixed gradient tensors in one kernel (:attr:`holds_grads`); a parameter whose gradient is some
        other tensor lets it go, so the next micro-step binds it again from zero."""
        for param, fixed in zip(self._trainable(), self._grads, strict=True):
            if param.grad is not fixed:
                param.grad = None
        torch._foreach_zero_(self._grads)

    def _trainable(self) -> list[torch.nn.Parameter]:
        if self._params is None:
            self._params = self.parameters()
        return self._params

    def _bind_grads(self) -> None:
        """Point every trainable parameter's ``.grad`` at its fixed gradient tensor, keeping what it holds."""
        params = self._trainable()
        if len(self._grads) != len(params):
            self._grads = [torch.zeros_like(p) for p in params]
        if all(param.grad is fixed for param, fixed in zip(params, self._grads, strict=True)):
            return
        zero, sources, targets = [], [], []
        for param, fixed in zip(params, self._grads, strict=True):
            if param.grad is None:
                zero.append(fixed)
            elif param.grad is not fixed:
                sources.append(param.grad)
                targets.append(fixed)
            param.grad = fixed
        if zero:
            torch._foreach_zero_(zero)
        if targets:
            torch._foreach_copy_(targets, sources)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:160] if text else ""


# --- when it applies --------------------------------------------------------------------------------------------


def _has_dropout(model: torch.nn.Module) -> bool:
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return any(float(getattr(text, name, 0.0) or 0.0) > 0 for name in ("attention_dropout", "hidden_dropout"))


def unsupported_reason(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why this model's micro-steps cannot be captured as CUDA graphs here (None when they can)."""
    if device.type != "cuda":
        return "CUDA graphs need an NVIDIA GPU"
    if _has_dropout(model):
        return "the model uses dropout, whose masks a replayed recompute could not draw again"
    return None


def resolve(requested: bool | None, problem: str | None) -> tuple[bool, str]:
    """(on, reason). Automatic is on where graphs can run, on trial (:class:`Trial`); ``problem``:
    :func:`unsupported_reason`."""
    if requested is False:
        return False, "switched off: every micro-batch launches its work from Python"
    if problem is not None:
        return False, problem if requested else f"automatic: off; {problem}"
    if requested is None:
        return True, (
            "automatic: trying; a replayed micro-batch is timed against an eager one, and the graphs stay unless "
            "slower (rows padded into shape buckets, one step's activations kept reserved between steps)"
        )
    return True, "switched on: each micro-batch replays from a CUDA graph once its shape bucket has run once"
