"""What setting up the environment reports, as small frozen dataclasses (like a training run's events).

The CLI prints them, the app's setup view re-emits them as Qt signals, the tests iterate them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events import Event


@dataclass(frozen=True)
class SetupEvent(Event):
    """Base of every setup event."""


@dataclass(frozen=True)
class StepStarted(SetupEvent):
    """One stage of a job began (creating the environment, resolving, installing torch, ...)."""

    index: int
    total: int
    title: str


@dataclass(frozen=True)
class Progress(SetupEvent):
    """``done`` of ``total`` units (packages or wheels) in the current stage; ``total`` 0 means unknown."""

    done: int
    total: int
    item: str = ""


@dataclass(frozen=True)
class OutputLine(SetupEvent):
    """A line uv printed, for a details pane or a log."""

    text: str


@dataclass(frozen=True)
class SetupWarning(SetupEvent):
    text: str


@dataclass(frozen=True)
class SetupFinished(SetupEvent):
    summary: str
    restart_needed: bool = False


@dataclass(frozen=True)
class SetupFailed(SetupEvent):
    message: str
    hint: str = ""


@dataclass(frozen=True)
class SetupCancelled(SetupEvent):
    message: str
