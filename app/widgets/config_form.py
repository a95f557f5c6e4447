"""A form generated from the RunConfig dataclasses: one editor per field, its help text as the tooltip.

Each setting exists once, in engine.config; this module only maps a field's type to an editor (check box,
choice list, number, text), gives it a label in plain words, and reads the values back through
``RunConfig.from_dict``, so the engine's checks judge them. The few settings most people change come first, in
their own group; the rest sit in groups that "Advanced" shows. Every group's labels share one column width. A field
with a check of its own (the run name) says under itself, as it is typed, why its text is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin, get_type_hints

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.config import RunConfig, run_name_problem

AUTO, ON, OFF = "auto", "on", "off"
SECTION_TITLES = {
    "model": "Model",
    "data": "Data",
    "lora": "LoRA adapter",
    "training": "Training",
    "speed": "Speed optimizations",
    "dpo": "Preference tuning (DPO)",
    "grpo": "Reward tuning (GRPO)",
    "vision": "Images (vision-language models)",
    "output": "Output folder",
}
MAIN_TITLE = "Main settings"
EDITOR_WIDTH = 260
MAIN_FIELDS = (
    "training.epochs",
    "training.max_steps",
    "data.max_seq_len",
    "lora.rank",
    "training.learning_rate",
    "model.qlora",
    "data.eval_fraction",
    "training.keep_knowledge",
)
"""The settings most people change, shown first; the rest are in the advanced groups."""
LABELS = {
    "model.qlora": "4-bit base model (QLoRA)",
    "model.dtype": "Number format",
    "model.revision": "Hub revision",
    "model.trust_remote_code": "Run the model's own code",
    "model.allow_pickle_weights": "Allow .bin/.pt weights",
    "data.format": "Row format",
    "data.train_on_all_tokens": "Learn the prompts too",
    "data.max_seq_len": "Longest example (tokens)",
    "data.overlong": "Examples longer than that",
    "data.tokens_per_batch": "Tokens per row",
    "data.eval_fraction": "Held-out share",
    "data.eval_path": "Held-out file",
    "lora.rank": "Adapter size (rank)",
    "lora.alpha": "Adapter scale (alpha)",
    "lora.dropout": "Adapter dropout",
    "lora.target_modules": "Layers adapted",
    "training.max_steps": "Steps (0: from passes)",
    "training.epochs": "Passes over the data",
    "training.learning_rate": "Learning rate",
    "training.weight_decay": "Weight decay",
    "training.optimizer": "AdamW kernel",
    "training.step_readout": "Loss readout",
    "training.warmup_steps": "Warm-up steps",
    "training.early_stop": "Stop after evaluations without gain",
    "training.keep_knowledge": "Keep what the model knew",
    "training.schedule": "Learning-rate schedule",
    "training.grad_accum": "Rows per step",
    "training.max_grad_norm": "Gradient clipping",
    "training.eval_every": "Evaluate every N steps",
    "training.save_every": "Save every N steps",
    "training.seed": "Random seed",
    "training.device": "Device",
    "training.max_bad_steps": "Stop after bad steps",
    "training.gpus": "GPUs",
    "training.parallel": "Multi-GPU mode",
    "training.nodes": "Computers",
    "training.node_rank": "This computer's node rank",
    "training.rendezvous": "Meeting address (node 0's HOST:PORT)",
    "training.rendezvous_timeout": "Wait for the other computers (s)",
    "training.node_timeout": "Stop when a computer is silent for (s)",
    "speed.metadata_cache": "Metadata cache",
    "speed.checkpointing": "Activation checkpointing",
    "speed.moe_routing": "MoE routing",
    "speed.attention_backend": "Attention kernel",
    "speed.fused_loss": "Fused loss",
    "speed.chunked_mlp": "Chunked MLP",
    "speed.host_embedding": "Embedding in host memory",
    "speed.lora_16bit": "16-bit LoRA",
    "speed.fused_kernels": "Fused kernels",
    "speed.fp8_base": "fp8 products",
    "output.dir": "Runs folder",
    "output.name": "Run name",
    "output.keep_checkpoints": "Checkpoints kept",
}
"""Labels in plain words; a field without one shows its name."""
CHECKBOX_TEXT = {
    "model.trust_remote_code": "only for models you trust: the repository's Python code runs on this computer",
    "model.allow_pickle_weights": "only for models you trust: loading pickle files (.bin/.pt) can run code",
    "model.qlora": "uses about a quarter of the memory for the base weights; a little slower",
    "data.train_on_all_tokens": "also learn the questions, not only the answers",
}
"""What a check box does, written beside it where the label alone could mislead."""


FIELD_CHECKS: dict[str, Callable[[str], str | None]] = {
    "output.name": lambda text: run_name_problem(text) if text else None,  # empty: the default name
}
"""Text fields checked as they are typed: the reason a text is refused, shown under the field (None: fine)."""
ERROR_COLOUR = "#b00020"


AUTOMATIC_AT_ZERO = frozenset(
    {
        "data.max_seq_len",
        "data.tokens_per_batch",
        "lora.rank",
        "training.learning_rate",
        "training.epochs",
        "lora.alpha",
    }
)
"""Settings whose 0 means automatic (chosen for the device, the model and the data at the run's start); a number
field among them shows "automatic" while empty, and empty reads back as 0."""
AUTOMATIC_TEXT = "automatic"
AUTOMATIC_SPIN = -1
"""A whole-number setting that may be automatic (None) shows "automatic" at this value, one below zero."""
AUTOMATIC_PROPERTY = "automatic_at_zero"


def _editor(annotation: Any) -> QWidget:
    options = get_args(annotation)
    if annotation is bool:
        return QCheckBox()
    if get_origin(annotation) is Literal:
        box = QComboBox()
        box.addItems([str(o) for o in options])
        return box
    if bool in options and type(None) in options:
        box = QComboBox()
        box.addItems([AUTO, ON, OFF])
        return box
    if annotation is int:
        spin = QSpinBox()
        spin.setRange(0, 10_000_000)
        return spin
    if int in options and type(None) in options:  # automatic (None) sits below zero, shown as "automatic"
        spin = QSpinBox()
        spin.setRange(AUTOMATIC_SPIN, 10_000_000)
        spin.setSpecialValueText(AUTOMATIC_TEXT)
        return spin
    return QLineEdit()


def _set(widget: QWidget, value: Any) -> None:
    if isinstance(widget, QCheckBox):
        widget.setChecked(bool(value))
    elif isinstance(widget, QComboBox):
        text = {None: AUTO, True: ON, False: OFF}.get(value, str(value)) if not isinstance(value, str) else value
        widget.setCurrentText(text)
    elif isinstance(widget, QSpinBox):
        widget.setValue(AUTOMATIC_SPIN if value is None else int(value))
    elif isinstance(widget, QLineEdit) and widget.property(AUTOMATIC_PROPERTY) and value == 0:
        widget.setText("")
    elif isinstance(widget, QLineEdit):
        widget.setText(",".join(value) if isinstance(value, list) else "" if value is None else f"{value:g}"
                       if isinstance(value, float) else str(value))  # fmt: skip


def _get(widget: QWidget, annotation: Any) -> Any:
    if isinstance(widget, QCheckBox):
        return widget.isChecked()
    if isinstance(widget, QComboBox):
        text = widget.currentText()
        if get_origin(annotation) is Literal:
            return text
        return {AUTO: None, ON: True, OFF: False}[text]
    if isinstance(widget, QSpinBox):
        return None if widget.value() == AUTOMATIC_SPIN else widget.value()
    text = widget.text().strip()  # type: ignore[attr-defined]
    options = [o for o in get_args(annotation) if o is not type(None)]
    if not text and widget.property(AUTOMATIC_PROPERTY):
        return 0.0 if annotation is float else 0
    if not text and type(None) in get_args(annotation):
        return None
    number = annotation if annotation in (int, float) else options[0] if len(options) == 1 else None
    if number in (int, float):
        try:
            return number(text)
        except ValueError:
            return text  # the config check names the field
    if get_origin(annotation) is list or (options and get_origin(options[0]) is list):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def label_for(key: str) -> str:
    return LABELS.get(key, key.split(".")[1].replace("_", " ").capitalize())


def tooltip_for(key: str, spec: dataclasses.Field[Any]) -> str:
    """The field's help text from engine.config, and the setting's name in config.json and on the command line."""
    flag = spec.metadata.get("flag")
    where = f"{key} in config.json" + (f", {flag} for tunedeck train" if flag else "")
    help_text = spec.metadata.get("help", "")
    return f"{help_text[:1].upper()}{help_text[1:]}.\n({where})" if help_text else f"({where})"


class ConfigForm(QWidget):
    """Editors for every RunConfig field except ``skip`` (set elsewhere, e.g. the model and dataset pages)."""

    def __init__(self, skip: frozenset[str] = frozenset(), main: tuple[str, ...] = MAIN_FIELDS) -> None:
        super().__init__()
        self.editors: dict[tuple[str, str], tuple[QWidget, Any]] = {}
        self.labels: dict[str, QLabel] = {}
        self.problems: dict[str, QLabel] = {}
        """Under each checked field (FIELD_CHECKS): why its text is refused, hidden while it is fine."""
        specs = _field_specs(skip)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.main_group = self._group(MAIN_TITLE, [key for key in main if key in specs], specs)
        layout.addWidget(self.main_group)
        self.advanced_button = QPushButton("Advanced settings ▸")
        self.advanced_button.setCheckable(True)
        self.advanced_button.setToolTip("Every setting of the run, grouped as in config.json")
        self.advanced_button.toggled.connect(self.set_advanced_visible)
        layout.addWidget(self.advanced_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.advanced_groups: list[QGroupBox] = []
        for section in dataclasses.fields(RunConfig):
            keys = [key for key in specs if key.startswith(f"{section.name}.") and key not in main]
            if keys:
                group = self._group(SECTION_TITLES.get(section.name, section.name.capitalize()), keys, specs)
                self.advanced_groups.append(group)
                layout.addWidget(group)
        layout.addStretch(1)
        width = max(label.sizeHint().width() for label in self.labels.values())
        for label in self.labels.values():  # one label column across every group
            label.setMinimumWidth(width)
        self.set_config(RunConfig())
        self.set_advanced_visible(False)

    def _group(self, title: str, keys: list[str], specs: dict[str, tuple[Any, Any]]) -> QGroupBox:
        group = QGroupBox(title)
        form = QFormLayout(group)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        for key in keys:
            spec, annotation = specs[key]
            editor = _editor(annotation)
            if isinstance(editor, QCheckBox) and key in CHECKBOX_TEXT:
                editor.setText(CHECKBOX_TEXT[key])
            if isinstance(editor, QSpinBox) and key in AUTOMATIC_AT_ZERO:
                editor.setSpecialValueText(AUTOMATIC_TEXT)  # shown at 0, the config's automatic value
            if isinstance(editor, QLineEdit) and (key in AUTOMATIC_AT_ZERO or type(None) in get_args(annotation)):
                editor.setPlaceholderText(AUTOMATIC_TEXT)  # empty: the config's automatic value (None, or 0)
                editor.setProperty(AUTOMATIC_PROPERTY, key in AUTOMATIC_AT_ZERO)
            if not isinstance(editor, QCheckBox):
                editor.setFixedWidth(EDITOR_WIDTH)  # one editor width too, so the groups line up
            editor.setToolTip(tooltip_for(key, spec))
            editor.setObjectName(key)
            label = QLabel(label_for(key))
            label.setToolTip(editor.toolTip())
            form.addRow(label, editor)
            if key in FIELD_CHECKS and isinstance(editor, QLineEdit):
                self._add_check(form, key, editor)
            section, name = key.split(".")
            self.labels[key] = label
            self.editors[(section, name)] = (editor, annotation)
        return group

    def _add_check(self, form: QFormLayout, key: str, editor: QLineEdit) -> None:
        problem = QLabel("")
        problem.setWordWrap(True)
        problem.setStyleSheet(f"color:{ERROR_COLOUR}")
        problem.setObjectName(f"{key}.problem")
        problem.hide()
        form.addRow("", problem)
        self.problems[key] = problem
        editor.textChanged.connect(lambda text, key=key: self._check_field(key, text))

    def _check_field(self, key: str, text: str) -> None:
        reason = FIELD_CHECKS[key](text.strip())
        label, editor = self.problems[key], self.editor(key)
        label.setText(f"{label_for(key)} {reason}" if reason else "")
        label.setVisible(reason is not None)
        editor.setStyleSheet(f"border: 1px solid {ERROR_COLOUR}" if reason else "")

    def field_problem(self, key: str) -> str | None:
        """Why the text of checked field ``key`` is refused, or None when it is fine."""
        return self.problems[key].text() or None

    def set_advanced_visible(self, visible: bool) -> None:
        """Show or hide every group but the main one (the full form)."""
        self.advanced_button.setChecked(visible)
        self.advanced_button.setText("Advanced settings ▾" if visible else "Advanced settings ▸")
        for group in self.advanced_groups:
            group.setVisible(visible)

    def set_config(self, config: RunConfig) -> None:
        raw = config.to_dict()
        for (section, name), (editor, _) in self.editors.items():
            _set(editor, raw[section][name])

    def set_values(self, values: dict[str, Any]) -> None:
        """Set some fields ('section.field' -> value); the others keep what they show."""
        for key, value in values.items():
            section, name = key.split(".")
            if (section, name) in self.editors:
                _set(self.editors[(section, name)][0], value)

    def values(self) -> dict[str, dict[str, Any]]:
        raw: dict[str, dict[str, Any]] = {}
        for (section, name), (editor, annotation) in self.editors.items():
            raw.setdefault(section, {})[name] = _get(editor, annotation)
        return raw

    def editor(self, key: str) -> QWidget:
        section, name = key.split(".")
        return self.editors[(section, name)][0]


def _field_specs(skip: frozenset[str]) -> dict[str, tuple[Any, Any]]:
    """'section.field' -> (dataclass field, type) for every RunConfig field not in ``skip``, in config order."""
    specs: dict[str, tuple[Any, Any]] = {}
    defaults = RunConfig()
    for section in dataclasses.fields(RunConfig):
        section_type = type(getattr(defaults, section.name))
        hints = get_type_hints(section_type)
        for spec in dataclasses.fields(section_type):
            key = f"{section.name}.{spec.name}"
            if key not in skip and get_origin(hints[spec.name]) is not tuple:  # rewards have a builder of their own
                specs[key] = (spec, hints[spec.name])
    return specs
