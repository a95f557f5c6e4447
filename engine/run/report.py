"""A run's before/after report: did the fine-tune get better on its held-out examples, and what did it forget?

The base model and each of the run's adapters (the best by held-out loss and the last) are scored side by side on
the run's own held-out examples (the split the run made, with its seed): the mean loss per learned token and its
perplexity, and for short answers the exact match and token F1 of greedy replies (engine.run.short_answers); a DPO
run scores its held-out pairs instead (their mean DPO loss against the base as reference, the share ranked right,
and the perplexity of the chosen answers). The forgetting check is the perplexity of a fixed
general-English text shipped in ``resources/general_text`` (public-domain prose, a few thousand tokens): a tuned
model that reads it much worse than its base has lost some of what it knew. One loaded base serves every column
(peft switches adapters), in the run's dtype on its device kind. ``report.md`` and ``report.json`` go into the
run folder; ``tunedeck report RUN`` prints them, and :func:`report_after_run` writes them when a run ends, for
``tunedeck train`` and the app alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig
from engine.data.packing import TokenizedExample, TokenizedPair, collate
from engine.data.prepare import prepare_data
from engine.model.adapter import RunAdapter, run_adapter
from engine.model.load import load_base_model, load_tokenizer, pick_device, pick_dtype
from engine.run import checkpoint as ckpt
from engine.run.folder import load_run_config
from engine.run.preference import document_log_probs, pair_losses
from engine.run.short_answers import ShortAnswer, answer_scores, short_answers

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
BATCH_TOKENS = 2048

Cancelled = Callable[[], bool]
"""Asked between batches of a report's measurement: True stops it (the app closing while a report is measured)."""


def never() -> bool:
    return False


class ReportCancelled(Exception):
    """The report's measurement was stopped before its end; nothing was written."""


"""Tokens of one scoring pass (documents packed, positions restarting at each)."""
WINDOW = 512
"""The general text is read in windows of this many tokens (or the model's context, if shorter)."""


def general_text_files() -> list[Path]:
    """The forgetting check's texts, in a fixed order."""
    import resources

    return sorted((Path(resources.__file__).parent / "general_text").glob("*.txt"))


@dataclass(frozen=True)
class ModelScores:
    """One column of the report: the base model or one of the run's adapters."""

    label: str
    held_out_loss: float | None
    """SFT: mean loss per learned token of the held-out examples; DPO: the held-out pairs' mean DPO loss."""
    held_out_perplexity: float | None
    """exp of the mean loss per learned token (DPO: of the chosen answers)."""
    reward_accuracy: float | None
    """DPO: the share of held-out pairs whose chosen answer gets the higher reward (None for SFT)."""
    general_perplexity: float
    """Perplexity of the general-English text (the forgetting check)."""
    exact_match: float | None = None
    """SFT: the share of short held-out answers the model says exactly (SQuAD-normalised; None when not scored)."""
    token_f1: float | None = None
    """SFT: the mean token F1 of its replies against the short held-out answers (None when not scored)."""


@dataclass(frozen=True)
class RunReport:
    run: str
    method: str
    held_out_examples: int
    held_out_tokens: int
    general_tokens: int
    models: list[ModelScores]
    answers_scored: int = 0
    """How many short held-out answers exact match and token F1 were measured on (0: not scored)."""
    answers_note: str = ""
    """Which answers were scored, or why none were."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunReport:
        return cls(**{**raw, "models": [ModelScores(**m) for m in raw["models"]]})

    def markdown(self) -> str:
        pairs = self.method == "dpo"
        held_out = (
            f"{self.held_out_examples} held-out {'pairs' if pairs else 'examples'} ({self.held_out_tokens} tokens)"
        )
        rows = [
            ("held-out " + ("DPO loss" if pairs else "loss"), [_num(m.held_out_loss) for m in self.models]),
            ("held-out perplexity" + (" (chosen answers)" if pairs else ""),
             [_num(m.held_out_perplexity, ",.2f") for m in self.models]),
        ]  # fmt: skip
        if pairs:
            rows.append(("held-out reward accuracy", [_share(m.reward_accuracy) for m in self.models]))
        if self.answers_scored:
            rows.append(("short answers: exact match", [_share(m.exact_match) for m in self.models]))
            rows.append(("short answers: token F1", [_share(m.token_f1) for m in self.models]))
        rows.append(("general-text perplexity (forgetting)", [_num(m.general_perplexity, ",.2f") for m in self.models]))
        lines = [
            f"# Before and after: {self.run}",
            "",
            f"{held_out}; forgetting check: {self.general_tokens} tokens of public-domain English prose "
            "(resources/general_text).",
            "",
            "| | " + " | ".join(m.label for m in self.models) + " |",
            "|---|" + "---:|" * len(self.models),
            *(f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows),
            "",
            *([f"Exact match and token F1: {self.answers_note}.", ""] if self.answers_note else []),
            *self._verdict(),
        ]
        return "\n".join(lines) + "\n"

    def _verdict(self) -> list[str]:
        """One line per adapter: better or worse than the base on held-out data, and how much it forgot."""
        base, lines = self.models[0], []
        for tuned in self.models[1:]:
            if tuned.held_out_loss is not None and base.held_out_loss is not None:
                change = "lower (better)" if tuned.held_out_loss < base.held_out_loss else "higher (worse)"
                lines.append(f"* {tuned.label}: held-out loss {change} than the base model's.")
            lines.append(f"* {tuned.label}: {forgetting_line(base, tuned)}.")
        return lines


FORGETTING_WORDS = ((0.0, "nothing forgotten"), (0.10, "little forgotten"), (0.50, "some forgotten"))
"""Up to each rise of the general-English perplexity over the base model's, these words; above the last, much."""


def forgetting_line(base: ModelScores, tuned: ModelScores) -> str:
    """The forgetting check in words: "general English perplexity: 18.2 → 19.0 (+4%): little forgotten"."""
    drift = tuned.general_perplexity / base.general_perplexity - 1
    words = next((text for limit, text in FORGETTING_WORDS if drift <= limit), "much forgotten")
    return (
        f"general English perplexity: {base.general_perplexity:,.1f} → {tuned.general_perplexity:,.1f} "
        f"({drift:+.0%}): {words}"
    )


def _num(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _check(cancelled: Cancelled) -> None:
    if cancelled():
        raise ReportCancelled("the report was stopped before its end")


def _chunks(items: Sequence[TokenizedExample], cancelled: Cancelled = never) -> Iterator[list[TokenizedExample]]:
    """``items`` in batches of at most BATCH_TOKENS tokens (or one longer item), asking ``cancelled`` before each."""
    chunk: list[TokenizedExample] = []
    for item in items:
        if chunk and sum(len(c) for c in chunk) + len(item) > BATCH_TOKENS:
            _check(cancelled)
            yield chunk
            chunk = []
        chunk.append(item)
    if chunk:
        _check(cancelled)
        yield chunk


def _log_probs(model: Any, items: list[TokenizedExample], device: torch.device) -> torch.Tensor:
    """(D,) each document's summed log-probability of its learned tokens (a pair is two documents)."""
    batch = collate(items).to(device)
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    return document_log_probs(model, inputs, batch).float()


@torch.no_grad()
def _text_loss(
    model: Any, items: Sequence[TokenizedExample], device: torch.device, cancelled: Cancelled = never
) -> tuple[float, int]:
    """(mean loss per learned token, learned tokens) over ``items``."""
    total, tokens = 0.0, 0
    for chunk in _chunks(items, cancelled):
        total -= float(_log_probs(model, chunk, device).sum())
        tokens += sum(item.trained_tokens for item in chunk)
    return total / max(tokens, 1), tokens


@torch.no_grad()
def _pair_scores(
    model: Any,
    pairs: Sequence[TokenizedExample],
    config: RunConfig,
    device: torch.device,
    adapter_on: bool,
    cancelled: Cancelled = never,
) -> tuple[float, float, float]:
    """(mean DPO loss, reward accuracy, chosen answers' perplexity) of the held-out pairs, the base model (adapter
    off) as reference; the base model itself (``adapter_on`` False) is its own reference: a zero margin for all."""
    losses, right, chosen_loss, chosen_tokens = 0.0, 0, 0.0, 0
    for chunk in _chunks(pairs, cancelled):
        with model.disable_adapter():
            reference = _log_probs(model, chunk, device).view(-1, 2)
        policy = _log_probs(model, chunk, device).view(-1, 2) if adapter_on else reference
        counts = [item.answer_tokens if isinstance(item, TokenizedPair) else (1, 1) for item in chunk]
        answer_tokens = torch.tensor(counts, dtype=torch.float32, device=policy.device)
        losses += float(pair_losses(policy, reference, config.dpo.beta, config.dpo.loss, answer_tokens).sum())
        ratios = policy - reference
        right += int((ratios[:, 0] > ratios[:, 1]).sum())
        chosen_loss -= float(policy[:, 0].sum())
        chosen_tokens += int(answer_tokens[:, 0].sum())
    count = max(len(pairs), 1)
    return losses / count, right / count, math.exp(chosen_loss / max(chosen_tokens, 1))


def general_examples(tokenizer: Any, window: int) -> list[TokenizedExample]:
    """The general text as windows of ``window`` tokens, every token learned but each window's first."""
    examples = []
    for path in general_text_files():
        ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), window):
            part = tuple(ids[start : start + window])
            if len(part) > 1:
                examples.append(TokenizedExample(part, part))
    return examples


def _columns(run_dir: Path, last_step: int | None) -> list[RunAdapter]:
    """The run's adapters to score: the best and the last (one column where the run kept no best, or where the
    best is the last)."""
    best, last = run_adapter(run_dir, "best"), run_adapter(run_dir, "last")
    if best is not None and best.which == "best" and best.step is not None and best.step == last_step:
        last = None
    found = [a for a in (best, last) if a is not None]
    if not found:
        from engine.errors import TuneDeckError

        raise TuneDeckError(
            f"{run_dir} has no adapter to report on",
            hint="a run writes adapter/ when it finishes or is stopped; resume it first",
        )
    return list({a.folder: a for a in found}.values())


def _label(adapter: RunAdapter, last_step: int | None) -> str:
    if adapter.which == "best" and adapter.step is not None and adapter.step == last_step:
        return f"best and last adapter (step {adapter.step})"
    if adapter.which == "best":
        return f"best adapter (step {adapter.step})" if adapter.step is not None else "best adapter"
    return f"last adapter (step {last_step})" if last_step is not None else "last adapter"


def _last_step(run_dir: Path) -> int | None:
    path = run_dir / "metrics.jsonl"
    for line in reversed(path.read_text(encoding="utf-8").splitlines() if path.exists() else []):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def build_report(run_dir: str | Path, device: str | None = None, cancelled: Cancelled = never) -> RunReport:
    """Score the base model and the run's adapters on its held-out data and on the general text, on ``device``
    (by default the run's own setting). ``cancelled`` is asked between batches; True raises ReportCancelled."""
    from peft import PeftModel

    run_dir = Path(run_dir)
    config = load_run_config(run_dir)
    last_step = _last_step(run_dir)
    adapters = _columns(run_dir, last_step)
    torch_device = pick_device(device or config.training.device)
    model_config = config.model if torch_device.type == "cuda" else dataclasses.replace(config.model, qlora=False)
    tokenizer = load_tokenizer(model_config)
    data = prepare_data(config.data, tokenizer, config.training.seed, config.training.method)
    _check(cancelled)
    base = load_base_model(model_config, torch_device, pick_dtype(model_config.dtype, torch_device))
    _check(cancelled)
    context = int(getattr(base.config, "max_position_embeddings", WINDOW) or WINDOW)
    general = general_examples(tokenizer, min(WINDOW, context))
    names = [f"adapter_{i}" for i in range(len(adapters))]
    model = PeftModel.from_pretrained(base, str(adapters[0].folder), adapter_name=names[0])
    for name, adapter in zip(names[1:], adapters[1:], strict=True):
        model.load_adapter(str(adapter.folder), adapter_name=name)
    model.eval()
    answers, note = _short_answers(config, data.eval)
    base_scores = _scores(model, "base model", data.eval, general, config, torch_device, False, cancelled)
    _check(cancelled)
    columns = [_with_answers(base_scores, model, tokenizer, answers, torch_device, adapter_on=False)]
    for name, adapter in zip(names, adapters, strict=True):
        model.set_adapter(name)
        scores = _scores(model, _label(adapter, last_step), data.eval, general, config, torch_device, True, cancelled)
        _check(cancelled)
        columns.append(_with_answers(scores, model, tokenizer, answers, torch_device))
    held_out_tokens = sum(len(item) for item in data.eval)
    return RunReport(
        run_dir.name, config.training.method, len(data.eval), held_out_tokens, sum(len(g) for g in general), columns,
        len(answers), note,
    )  # fmt: skip


def _short_answers(config: RunConfig, held_out: Sequence[TokenizedExample]) -> tuple[list[ShortAnswer], str]:
    if config.training.method == "dpo":
        return [], "not scored: a preference run is judged by its reward accuracy"
    return short_answers(held_out)


def _with_answers(
    scores: ModelScores,
    model: Any,
    tokenizer: Any,
    answers: Sequence[ShortAnswer],
    device: torch.device,
    adapter_on: bool = True,
) -> ModelScores:
    """``scores`` with the exact match and token F1 of the model's replies to the short answers' prompts."""
    if not answers:
        return scores
    with _adapter(model, adapter_on):
        measured = answer_scores(model, tokenizer, answers, device)
    return dataclasses.replace(scores, exact_match=measured.exact_match, token_f1=measured.token_f1)


def _scores(
    model: Any,
    label: str,
    held_out: Sequence[TokenizedExample],
    general: Sequence[TokenizedExample],
    config: RunConfig,
    device: torch.device,
    adapter_on: bool = True,
    cancelled: Cancelled = never,
) -> ModelScores:
    if config.training.method == "dpo" and held_out:
        loss, accuracy, perplexity = _pair_scores(model, held_out, config, device, adapter_on, cancelled)
        with _adapter(model, adapter_on):
            general_loss, _ = _text_loss(model, general, device, cancelled)
        return ModelScores(label, loss, perplexity, accuracy, math.exp(general_loss))
    with _adapter(model, adapter_on):
        general_loss, _ = _text_loss(model, general, device, cancelled)
        held_out_loss = _text_loss(model, held_out, device, cancelled)[0] if held_out else None
    held_out_perplexity = math.exp(held_out_loss) if held_out_loss is not None else None
    return ModelScores(label, held_out_loss, held_out_perplexity, None, math.exp(general_loss))


def _adapter(model: Any, on: bool) -> Any:
    """The active adapter as it is, or switched off for the base model's column."""
    return contextlib.nullcontext() if on else model.disable_adapter()


def write_report(run_dir: str | Path, report: RunReport) -> Path:
    """``report.md`` and ``report.json`` in the run folder (each written atomically); returns the Markdown file."""
    run_dir = Path(run_dir)
    ckpt.write_text_atomic(run_dir / REPORT_JSON, json.dumps(report.to_dict(), indent=2) + "\n")
    ckpt.write_text_atomic(run_dir / REPORT_MD, report.markdown())
    return run_dir / REPORT_MD


def read_report(run_dir: str | Path) -> RunReport | None:
    """The report written before, or None (none yet, or unreadable)."""
    try:
        return RunReport.from_dict(json.loads((Path(run_dir) / REPORT_JSON).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class ReportOutcome:
    """What measuring a finished run's report gave: the report and its Markdown file, or a note saying why not."""

    report: RunReport | None
    path: Path | None
    note: str | None
    """Why there is no report, with the command that tries again (None when there is one)."""


def report_after_run(run_dir: str | Path, device: str | None = None, cancelled: Cancelled = never) -> ReportOutcome:
    """Measure a run's before/after report and write it into its folder, whoever started the run (``tunedeck
    train``, the app). Never raises for a failure to measure: the run's adapters are safe and the report can be made
    later, so the failure comes back as a note with the command to retry. ``cancelled`` stops it between batches
    (the app closing): nothing is written and the note says so."""
    run_dir = Path(run_dir)
    try:
        report = build_report(run_dir, device, cancelled)
        return ReportOutcome(report, write_report(run_dir, report), None)
    except ReportCancelled:
        return ReportOutcome(
            None, None, f"no before/after report: stopped before its end; try: tunedeck report {run_dir}"
        )
    except Exception as err:  # any failure: the report is an extra, never the run's end
        note = f"no before/after report ({type(err).__name__}: {err}); try: tunedeck report {run_dir}"
        return ReportOutcome(None, None, note)
