"""A run's before/after report: did the fine-tune get better on its held-out examples, and what did it forget?

The base model and each of the run's adapters (the best by held-out loss and the last) are scored side by side on
the run's own held-out examples (the split the run made, with its seed): the mean loss per learned token and its
perplexity, and for short answers the exact match and token F1 of greedy replies (engine.run.short_answers).

A DPO run compares like with like: its first column is the model the run started from (the starting adapter, or the
base model), and every column is measured by what means something before training: the share of held-out pairs
whose chosen answer the model gives the higher log-probability per token (chance is 50%), and the chosen answers'
perplexity. The adapters also get the held-out DPO loss and reward accuracy against the run's own reference; the
starting model has none (against itself, every reward is zero by definition). The forgetting check is the perplexity
of a fixed
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
from typing import Any, Literal

import torch

from engine.config import RunConfig
from engine.data.packing import TokenizedExample, TokenizedPair, collate
from engine.data.prepare import PreparedData
from engine.method_facts import facts_for
from engine.model.adapter import RunAdapter, run_adapter
from engine.model.load import load_base_model, load_tokenizer, pick_device, pick_dtype
from engine.rewards import build_rewards
from engine.run import checkpoint as ckpt
from engine.run import knowledge
from engine.run.folder import load_run_config
from engine.run.knowledge import KEPT_WARNING
from engine.run.methods import method_for
from engine.run.methods.grpo import held_out_reward
from engine.run.methods.grpo_data import PromptData
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
    """One column of the report: the model before the run (the base model, or a DPO run's starting adapter) or one of
    the run's adapters. A new measure (a knowledge check, say) is a field here and a :class:`Measure` row."""

    label: str
    held_out_loss: float | None
    """SFT: mean loss per learned token of the held-out examples; DPO: the held-out pairs' mean DPO loss against the
    run's reference (None for the model the run started from)."""
    held_out_perplexity: float | None
    """exp of the mean loss per learned token (DPO: of the chosen answers)."""
    reward_accuracy: float | None
    """DPO: the share of held-out pairs whose chosen answer gets the higher reward against the run's reference (None
    for the model the run started from, and for SFT)."""
    general_perplexity: float
    """Perplexity of the general-English text (the forgetting check)."""
    exact_match: float | None = None
    """SFT: the share of short held-out answers the model says exactly (SQuAD-normalised; None when not scored)."""
    token_f1: float | None = None
    """SFT: the mean token F1 of its replies against the short held-out answers (None when not scored)."""
    preferred: float | None = None
    """DPO: the share of held-out pairs whose chosen answer the model gives the higher log-probability per token
    than the rejected one (no reference; chance is 50%)."""
    knowledge_right: int | None = None
    """The knowledge check (engine.run.knowledge): how many of its questions the model answers right."""
    knowledge_kept: int | None = None
    """Of the questions the base model answers right, how many this model still does (the base: all of them)."""
    knowledge_newly: int | None = None
    """Questions this model answers right that the base model did not."""
    knowledge_kept_share: float | None = None
    """knowledge_kept over the base model's right answers (None when the base got none right)."""
    mean_reward: float | None = None
    """GRPO: the mean total reward of the model's greedy answers to the held-out prompts."""


CHANCE = 0.5
"""Where a model that cannot tell a pair's answers apart lands on the share of pairs preferred."""


@dataclass(frozen=True)
class Measure:
    """One row of the report: which :class:`ModelScores` field, what it is called (``name`` in the text,
    ``short_name`` on the app's chart), which way is better, how it is written (``spec`` in the text, ``short`` on
    the chart), and ``chance``, where guessing scores something."""

    field: str
    name: str
    short_name: str
    better: Literal["lower", "higher"]
    spec: str
    short: str
    chance: float | None = None

    def value(self, scores: ModelScores) -> float | None:
        value = getattr(scores, self.field)
        return None if value is None else float(value)

    def text(self, value: float | None) -> str:
        return "-" if value is None else format(value, self.spec)


PAIR_MEASURES = (
    Measure("preferred", "held-out pairs preferred (chosen likelier per token; chance is 50%)",
            "held-out pairs preferred", "higher", ".0%", ".0%", CHANCE),
    Measure("held_out_loss", "held-out DPO loss (against the run's reference)",
            "held-out DPO loss, against the reference", "lower", ".4f", ".3f"),
    Measure("reward_accuracy", "held-out reward accuracy (against the run's reference)",
            "held-out reward accuracy, against the reference", "higher", ".0%", ".0%"),
    Measure("held_out_perplexity", "held-out perplexity (chosen answers)",
            "held-out perplexity of the chosen answers", "lower", ",.2f", ",.1f"),
)  # fmt: skip
DOCUMENT_MEASURES = (
    Measure("held_out_loss", "held-out loss", "held-out loss", "lower", ".4f", ".3f"),
    Measure("held_out_perplexity", "held-out perplexity", "held-out perplexity", "lower", ",.2f", ",.1f"),
)


def measures(method: str, answers_scored: bool, knowledge: bool = False) -> list[Measure]:
    """The report's rows, top to bottom, for a run of ``method`` (its own rows come from its report section)."""
    rows: list[Measure] = []
    if knowledge:
        rows.append(
            Measure("knowledge_kept_share", "knowledge kept (of the questions the base model answers right)",
                    "knowledge kept", "higher", ".0%", ".0%")
        )  # fmt: skip
    rows += SECTIONS[facts_for(method).report].measures
    if answers_scored:
        rows += [
            Measure("exact_match", "short answers: exact match", "short answers: exact match", "higher", ".0%", ".0%"),
            Measure("token_f1", "short answers: token F1", "short answers: token F1", "higher", ".0%", ".0%"),
        ]
    rows.append(
        Measure("general_perplexity", "general-text perplexity (forgetting)", "general English perplexity: forgetting",
                "lower", ",.2f", ",.1f")
    )  # fmt: skip
    return rows


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
    knowledge_questions: int = 0
    """Questions the knowledge check asked each model (0: not measured)."""
    knowledge_base_right: int = 0
    """Of those, the ones the base model answers right."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunReport:
        return cls(**{**raw, "models": [ModelScores(**m) for m in raw["models"]]})

    def measures(self) -> list[Measure]:
        return measures(self.method, bool(self.answers_scored), bool(self.knowledge_questions))

    def knowledge_warning(self) -> str | None:
        """Where an adapter kept under 90% of what the base model knew: which, and which adapter kept most (None
        when every adapter kept enough, or the check was not measured)."""
        tuned = [m for m in self.models[1:] if m.knowledge_kept_share is not None]
        low = [m for m in tuned if m.knowledge_kept_share is not None and m.knowledge_kept_share < KEPT_WARNING]
        if not low:
            return None
        most = max(tuned, key=lambda m: (m.knowledge_kept_share or 0.0, m.knowledge_kept or 0))
        which = ", ".join(f"{m.label} {m.knowledge_kept} of {self.knowledge_base_right}" for m in low)
        return (
            f"knowledge lost: {which} of the questions the base model answers right were kept, under "
            f"{KEPT_WARNING:.0%}; the {most.label} kept most ({most.knowledge_kept_share:.0%})"
        )

    def markdown(self) -> str:
        section = SECTIONS[facts_for(self.method).report]
        held_out = f"{self.held_out_examples} held-out {section.noun} ({self.held_out_tokens} tokens)"
        rows = [(m.name, [m.text(m.value(scores)) for scores in self.models]) for m in self.measures()]
        lines = [
            f"# Before and after: {self.run}",
            "",
            f"{held_out}; forgetting check: {self.general_tokens} tokens of public-domain English prose "
            "(resources/general_text).",
            "",
            *([section.note, ""] if section.note else []),
            "| | " + " | ".join(m.label for m in self.models) + " |",
            "|---|" + "---:|" * len(self.models),
            *(f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows),
            "",
            *([f"Exact match and token F1: {self.answers_note}.", ""] if self.answers_note else []),
            *self._knowledge_note(),
            *self._verdict(),
        ]
        return "\n".join(lines) + "\n"

    def _knowledge_note(self) -> list[str]:
        if not self.knowledge_questions:
            return []
        note = (
            f"Knowledge check: {self.knowledge_questions} short general-knowledge questions (resources/knowledge), "
            f"answered greedily; the base model answers {self.knowledge_base_right} right, and each column keeps a "
            "share of those."
        )
        warning = self.knowledge_warning()
        return [note, "", *([f"**Warning: {warning}.**", ""] if warning else [])]

    def _verdict(self) -> list[str]:
        """One line per adapter: better or worse than the model before the run on held-out data, and how much it
        forgot."""
        before, lines = self.models[0], []
        for tuned in self.models[1:]:
            if tuned.preferred is not None and before.preferred is not None:
                lines.append(f"* {tuned.label}: {preferred_line(before, tuned)}.")
            elif tuned.held_out_loss is not None and before.held_out_loss is not None:
                change = "lower (better)" if tuned.held_out_loss < before.held_out_loss else "higher (worse)"
                lines.append(f"* {tuned.label}: held-out loss {change} than the {before.label}'s.")
            elif tuned.mean_reward is not None and before.mean_reward is not None:
                lines.append(
                    f"* {tuned.label}: held-out mean reward {before.mean_reward:.3f} → {tuned.mean_reward:.3f}."
                )
            if tuned.knowledge_kept is not None:
                lines.append(f"* {tuned.label}: {knowledge_line(self.knowledge_base_right, tuned)}.")
            lines.append(f"* {tuned.label}: {forgetting_line(before, tuned)}.")
        return lines


def knowledge_line(base_right: int, tuned: ModelScores) -> str:
    """The knowledge check in words: "kept 41 of 52 facts the base model knew (79%), 3 newly right"."""
    share = "" if tuned.knowledge_kept_share is None else f" ({tuned.knowledge_kept_share:.0%})"
    return (
        f"knowledge: kept {tuned.knowledge_kept} of {base_right} facts the base model knew{share}, "
        f"{tuned.knowledge_newly} newly right"
    )


PAIRS_NOTE = (
    "The first column is the model the run started from. Pairs preferred: the share of held-out pairs whose chosen "
    "answer the model gives a higher log-probability per token than the rejected one; chance is 50%, and it needs no "
    "reference, so it compares the model before the run with each adapter. DPO loss and reward accuracy are "
    "measured against the run's reference, against which the starting model has no reward to show."
)


def preferred_line(before: ModelScores, tuned: ModelScores) -> str:
    """The held-out pairs preferred, before and after: "held-out pairs preferred: 50% → 75% (chance is 50%)"."""
    assert before.preferred is not None and tuned.preferred is not None
    return f"held-out pairs preferred: {before.preferred:.0%} → {tuned.preferred:.0%} (chance is 50%)"


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
def pair_log_probs(
    model: Any, pairs: Sequence[TokenizedExample], device: torch.device, cancelled: Cancelled = never
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, 2) summed log-probabilities of each pair's chosen and rejected answer by ``model`` as it is (its active
    adapter), and (P, 2) their token counts."""
    scores, counts = [], []
    for chunk in _chunks(pairs, cancelled):
        scores.append(_log_probs(model, chunk, device).view(-1, 2).cpu())
        counts += [item.answer_tokens if isinstance(item, TokenizedPair) else (1, 1) for item in chunk]
    if not scores:
        return torch.zeros(0, 2), torch.zeros(0, 2)
    return torch.cat(scores), torch.tensor(counts, dtype=torch.float32)


def preferred_share(log_probs: torch.Tensor, answer_tokens: torch.Tensor) -> float:
    """The share of pairs whose chosen answer has the higher log-probability per token (a tie is not preferred)."""
    per_token = log_probs / answer_tokens.clamp(min=1)
    return float((per_token[:, 0] > per_token[:, 1]).float().mean()) if len(per_token) else 0.0


@dataclass(frozen=True)
class PairScores:
    """A column's figures on the held-out pairs."""

    preferred: float
    chosen_perplexity: float
    dpo_loss: float | None
    reward_accuracy: float | None


def pair_scores(
    policy: torch.Tensor, answer_tokens: torch.Tensor, reference: torch.Tensor | None, config: RunConfig
) -> PairScores:
    """The held-out pairs' figures from the column's log-probabilities (``policy``) and the run's reference (None for
    the model the run started from: measured against itself, every reward would be zero)."""
    chosen_loss = -float(policy[:, 0].sum()) / max(float(answer_tokens[:, 0].sum()), 1.0)
    if reference is None:
        return PairScores(preferred_share(policy, answer_tokens), math.exp(chosen_loss), None, None)
    losses = pair_losses(policy, reference, config.dpo.beta, config.dpo.loss, answer_tokens)
    ratios = policy - reference
    right = float((ratios[:, 0] > ratios[:, 1]).float().mean()) if len(ratios) else 0.0
    loss = float(losses.mean()) if len(losses) else 0.0
    return PairScores(preferred_share(policy, answer_tokens), math.exp(chosen_loss), loss, right)


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

    from engine.vision.export import run_vision_family

    run_dir = Path(run_dir)
    family = run_vision_family(run_dir)
    if family is not None:  # image examples
        return _vision_report(run_dir, family, device, cancelled)
    config = load_run_config(run_dir)
    last_step = _last_step(run_dir)
    adapters = _columns(run_dir, last_step)
    torch_device = pick_device(device or config.training.device)
    model_config = config.model if torch_device.type == "cuda" else dataclasses.replace(config.model, qlora=False)
    tokenizer = load_tokenizer(model_config)
    method = method_for(config.training.method)
    data = method.prepare(config.data, tokenizer, config.training.seed)
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
    labels = [_label(adapter, last_step) for adapter in adapters]
    inputs = ReportInputs(model, tokenizer, list(zip(names, labels, strict=True)), data, general, config, torch_device)
    built = SECTIONS[method.facts.report].columns(inputs, cancelled)
    held_out_tokens = sum(len(item) for item in data.eval)
    general_tokens = sum(len(g) for g in general)
    report = RunReport(
        run_dir.name, method.name, len(data.eval), held_out_tokens, general_tokens, built.columns,
        built.answers_scored, built.answers_note,
    )  # fmt: skip
    return _with_knowledge(report, model, tokenizer, torch_device, built.adapters, cancelled)


@dataclass(frozen=True)
class ReportInputs:
    """What a report section measures its columns with: one loaded base with every adapter of the run in it
    (``adapters``: peft name, column label), the run's held-out data and the general text."""

    model: Any
    tokenizer: Any
    adapters: list[tuple[str, str]]
    data: PreparedData
    general: list[TokenizedExample]
    config: RunConfig
    device: torch.device


@dataclass(frozen=True)
class BuiltColumns:
    """A report section's columns, the peft adapter each was measured with (None: the base model), and the short
    answers scored (with the note that says which, or why none)."""

    columns: list[ModelScores]
    adapters: list[str | None]
    answers_scored: int = 0
    answers_note: str = ""


@dataclass(frozen=True)
class ReportSection:
    """What a training method's report says: what its held-out items are called, a note above the table, its own
    rows, and how its columns are measured."""

    noun: str
    note: str | None
    measures: tuple[Measure, ...]
    columns: Callable[[ReportInputs, Cancelled], BuiltColumns]


def document_columns(inputs: ReportInputs, cancelled: Cancelled = never) -> BuiltColumns:
    """Supervised tuning's columns: held-out loss and perplexity, short answers and the forgetting check."""
    model, tokenizer, data, device = inputs.model, inputs.tokenizer, inputs.data, inputs.device
    answers, note = short_answers(data.eval)
    base_scores = _scores(model, "base model", data.eval, inputs.general, device, False, cancelled)
    _check(cancelled)
    columns = [_with_answers(base_scores, model, tokenizer, answers, device, adapter_on=False)]
    for name, label in inputs.adapters:
        model.set_adapter(name)
        scores = _scores(model, label, data.eval, inputs.general, device, True, cancelled)
        _check(cancelled)
        columns.append(_with_answers(scores, model, tokenizer, answers, device))
    return BuiltColumns(columns, [None, *(name for name, _ in inputs.adapters)], len(answers), note)


def pair_columns(inputs: ReportInputs, cancelled: Cancelled = never) -> BuiltColumns:
    """Preference tuning's columns: the model the run started from, then each adapter, on the held-out pairs."""
    start = _starting_adapter(inputs.config)
    if start is not None:
        inputs.model.load_adapter(str(start), adapter_name=START)
        inputs.model.eval()
    columns = _pair_columns(
        inputs.model, inputs.adapters, inputs.data.eval, inputs.general, inputs.config, inputs.device,
        start is not None, cancelled,
    )  # fmt: skip
    first = START if start is not None else None
    note = "not scored: a preference run is judged by the pairs it prefers"
    return BuiltColumns(columns, [first, *(name for name, _ in inputs.adapters)], 0, note)


DOCUMENTS_SECTION = ReportSection("examples", None, DOCUMENT_MEASURES, document_columns)
PAIRS_SECTION = ReportSection("pairs", PAIRS_NOTE, PAIR_MEASURES, pair_columns)
REWARD_MEASURES = (
    Measure("mean_reward", "held-out mean reward (greedy answers)", "held-out mean reward", "higher", ".3f", ".2f"),
)


def reward_columns(inputs: ReportInputs, cancelled: Cancelled = never) -> BuiltColumns:
    """Learning from rewards: the base model, then each adapter, by the mean reward of its greedy answers to the
    held-out prompts (the run's own rewards), and the forgetting check."""
    model, data = inputs.model, inputs.data
    assert isinstance(data, PromptData), "a GRPO run's held-out data are prompts"
    rewards = build_rewards(inputs.config.training.rewards)
    new = inputs.config.training.max_new_tokens

    def column(label: str) -> ModelScores:
        general_loss, _ = _text_loss(model, inputs.general, inputs.device, cancelled)
        reward = held_out_reward(model, inputs.tokenizer, data.eval_prompts, rewards, new)[0] if data.eval else None
        _check(cancelled)
        return ModelScores(label, None, None, None, math.exp(general_loss), mean_reward=reward)

    with model.disable_adapter():
        columns = [column("base model")]
    for name, label in inputs.adapters:
        model.set_adapter(name)
        columns.append(column(label))
    note = "not scored: a run that learns from rewards is judged by its rewards"
    return BuiltColumns(columns, [None, *(name for name, _ in inputs.adapters)], 0, note)


REWARDS_SECTION = ReportSection("prompts", None, REWARD_MEASURES, reward_columns)
SECTIONS = {"documents": DOCUMENTS_SECTION, "pairs": PAIRS_SECTION, "rewards": REWARDS_SECTION}
"""Each report kind a method's facts name (engine.method_facts.MethodFacts.report), and its section."""


def _vision_report(run_dir: Path, family: Any, device: str | None, cancelled: Cancelled) -> RunReport:
    """A vision-language run's report: its columns measured on the held-out image examples
    (engine.run.vision_report), worded as a text run's."""
    from engine.run.vision_report import measure_columns

    config = load_run_config(run_dir)
    last_step = _last_step(run_dir)
    adapters = [(_label(a, last_step), a.folder) for a in _columns(run_dir, last_step)]
    torch_device = pick_device(device or config.training.device)
    measured = measure_columns(
        config, family, adapters, torch_device, lambda tokenizer: general_examples(tokenizer, WINDOW),
        lambda: _check(cancelled),
    )  # fmt: skip
    columns = [
        ModelScores(
            label=c.label,
            held_out_loss=c.held_out_loss,
            held_out_perplexity=math.exp(min(c.held_out_loss, 50.0)) if c.held_out_loss is not None else None,
            reward_accuracy=None,
            general_perplexity=math.exp(min(c.general_loss, 50.0)),
            exact_match=c.exact_match,
            token_f1=c.token_f1,
        )
        for c in measured.columns
    ]
    scored = measured.held_out_examples
    note = "greedy replies to each held-out image's question" if scored else "no held-out image examples"
    return RunReport(
        run_dir.name, "sft", scored, measured.held_out_tokens, measured.general_tokens, columns, scored, note
    )


def _with_knowledge(
    report: RunReport,
    model: Any,
    tokenizer: Any,
    device: torch.device,
    adapters: Sequence[str | None],
    cancelled: Cancelled = never,
) -> RunReport:
    """``report`` with the knowledge check: the base model's answers, and what each column (``adapters``: the peft
    adapter of each column, None for the base model) kept of them."""
    try:
        with model.disable_adapter():
            base = knowledge.ask(model, tokenizer, device, cancelled=cancelled)
        columns = []
        for scores, adapter in zip(report.models, adapters, strict=True):
            tuned = base
            if adapter is not None:
                model.set_adapter(adapter)
                tuned = knowledge.ask(model, tokenizer, device, cancelled=cancelled)
            kept = knowledge.compare(base, tuned)
            columns.append(
                dataclasses.replace(
                    scores, knowledge_right=tuned.right, knowledge_kept=kept.kept, knowledge_newly=kept.newly_right,
                    knowledge_kept_share=kept.kept_share,
                )
            )  # fmt: skip
    except knowledge.KnowledgeCancelled as err:
        raise ReportCancelled(str(err)) from err
    return dataclasses.replace(report, models=columns, knowledge_questions=base.total, knowledge_base_right=base.right)


START = "starting_adapter"
"""The adapter name of a DPO run's starting adapter, loaded beside the run's own for the first column."""


def _starting_adapter(config: RunConfig) -> Path | None:
    """The adapter a DPO run started from (its "before"), or None where it started from the base model."""
    if config.model.adapter is None:
        return None
    from engine.run.session import starting_adapter_folder

    return starting_adapter_folder(config.model.adapter)


def _pair_columns(
    model: Any,
    adapters: Sequence[tuple[str, str]],
    held_out: Sequence[TokenizedExample],
    general: Sequence[TokenizedExample],
    config: RunConfig,
    device: torch.device,
    starts_from_adapter: bool,
    cancelled: Cancelled = never,
) -> list[ModelScores]:
    """A DPO run's columns: the model it started from, then each of ``adapters`` (peft name, label)."""
    with _as_started(model, starts_from_adapter):
        start, tokens = pair_log_probs(model, held_out, device, cancelled)
        general_loss, _ = _text_loss(model, general, device, cancelled)
    reference = start
    if starts_from_adapter and config.dpo.reference == "base":
        with model.disable_adapter():
            reference, _ = pair_log_probs(model, held_out, device, cancelled)
    label = "starting adapter" if starts_from_adapter else "base model"
    columns = [_pair_column(label, start, tokens, None, config, general_loss, bool(held_out))]
    for name, adapter_label in adapters:
        model.set_adapter(name)
        policy, _ = pair_log_probs(model, held_out, device, cancelled)
        general_loss, _ = _text_loss(model, general, device, cancelled)
        columns.append(_pair_column(adapter_label, policy, tokens, reference, config, general_loss, bool(held_out)))
    return columns


def _pair_column(
    label: str,
    policy: torch.Tensor,
    tokens: torch.Tensor,
    reference: torch.Tensor | None,
    config: RunConfig,
    general_loss: float,
    any_pairs: bool,
) -> ModelScores:
    if not any_pairs:
        return ModelScores(label, None, None, None, math.exp(general_loss))
    scores = pair_scores(policy, tokens, reference, config)
    return ModelScores(
        label, scores.dpo_loss, scores.chosen_perplexity, scores.reward_accuracy, math.exp(general_loss),
        preferred=scores.preferred,
    )  # fmt: skip


def _as_started(model: Any, starts_from_adapter: bool) -> Any:
    """The model as a DPO run started: its starting adapter on, or every adapter off (the base model)."""
    if not starts_from_adapter:
        return model.disable_adapter()
    model.set_adapter(START)
    return contextlib.nullcontext()


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
    device: torch.device,
    adapter_on: bool = True,
    cancelled: Cancelled = never,
) -> ModelScores:
    """An SFT column: held-out loss and perplexity, and the forgetting check."""
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
