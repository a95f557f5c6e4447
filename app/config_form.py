"""A form generated from the RunConfig dataclasses: one editor per field, its help text as the tooltip.

Each setting exists once, in engine.config; this module only maps a field's type to an editor (check box,
choice list, number, text) and reads the values back through ``RunConfig.from_dict``, so the engine's checks
judge them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args, get_origin, get_type_hints

from PySide6.QtWidgets import QCheckBox, QComboBox, QFormLayout, QGroupBox, QLineEdit, QSpinBox, QWidget

from engine.config import RunConfig

AUTO, ON, OFF = "auto", "on", "off"
SECTION_TITLES = {"lora": "LoRA adapter", "speed": "Speed optimizations", "output": "Output folder"}


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
    return QLineEdit()


def _set(widget: QWidget, value: Any) -> None:
    if isinstance(widget, QCheckBox):
        widget.setChecked(bool(value))
    elif isinstance(widget, QComboBox):
        text = {None: AUTO, True: ON, False: OFF}.get(value, str(value)) if not isinstance(value, str) else value
        widget.setCurrentText(text)
    elif isinstance(widget, QSpinBox):
        widget.setValue(int(value))
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
        return widget.value()
    text = widget.text().strip()  # type: ignore[attr-defined]
    options = [o for o in get_args(annotation) if o is not type(None)]
    if not text and type(None) in get_args(annotation):
        return None
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            return text  # the config check names the field
    if get_origin(annotation) is list or (options and get_origin(options[0]) is list):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


class ConfigForm(QWidget):
    """Editors for every RunConfig field except ``skip`` (set elsewhere, e.g. the model and dataset pages)."""

    def __init__(self, skip: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.editors: dict[tuple[str, str], tuple[QWidget, Any]] = {}
        layout = QFormLayout(self)
        defaults = RunConfig()
        for section in dataclasses.fields(RunConfig):
            section_type = type(getattr(defaults, section.name))
            hints = get_type_hints(section_type)
            group = QGroupBox(SECTION_TITLES.get(section.name, section.name.capitalize()))
            form = QFormLayout(group)
            for spec in dataclasses.fields(section_type):
                if f"{section.name}.{spec.name}" in skip:
                    continue
                editor = _editor(hints[spec.name])
                editor.setToolTip(spec.metadata.get("help", ""))
                editor.setObjectName(f"{section.name}.{spec.name}")
                form.addRow(spec.name.replace("_", " "), editor)
                self.editors[(section.name, spec.name)] = (editor, hints[spec.name])
            layout.addRow(group)
        self.set_config(defaults)

    def set_config(self, config: RunConfig) -> None:
        raw = config.to_dict()
        for (section, name), (editor, _) in self.editors.items():
            _set(editor, raw[section][name])

    def values(self) -> dict[str, dict[str, Any]]:
        raw: dict[str, dict[str, Any]] = {}
        for (section, name), (editor, annotation) in self.editors.items():
            raw.setdefault(section, {})[name] = _get(editor, annotation)
        return raw

    def editor(self, key: str) -> QWidget:
        section, name = key.split(".")
        return self.editors[(section, name)][0]
