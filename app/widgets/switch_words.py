"""The speed page's "On here?" column in plain words: whether a switch is on, and why, from the engine's state.

The engine reports each switch as ``{"on": bool, "reason": str}`` (or ``{"mode": ..., "reason": ...}``) with
reasons such as "automatic: off on CPU (...)" or "switched on; ...": accurate, but written for a log. Here the
prefix becomes who decided ("TuneDeck" for automatic choices, "you" for a flip, "Compare" for its own) and the
state comes first: "Off — TuneDeck's choice: on CPU (...)".
"""

from __future__ import annotations

from typing import Any

from app.background.ab_compare import ON_OFF_SWITCHES

CHECKPOINT_WORDS = {"none": "no checkpointing", "standard": "standard recompute", "offloaded": "offloaded"}


def _who(reason: str, on: bool, flipper: str = "you") -> tuple[str, str]:
    """(who decided, the rest of the reason) from an engine reason string; ``flipper``: who asked for a flip."""
    state = "on" if on else "off"
    for prefix, who in (
        (f"automatic: {state}", "TuneDeck's choice"),
        ("automatic:", "TuneDeck's choice"),
        (f"switched {state}:", f"{flipper} switched it {state}"),
        (f"switched {state};", f"{flipper} switched it {state}"),
    ):
        if reason.startswith(prefix):
            return who, reason[len(prefix) :].lstrip(" ,;:")
    return "", reason


def describe_state(switch: str, entry: dict[str, Any], idle: str | None = None, flipper: str = "you") -> str:
    """One line for a running job: "On — ..." / "Off — ..." / "Not here — ..." with the reason in plain words;
    ``flipper``: who flipped a switch the engine says was switched ("you", or "Compare" while it measures)."""
    if idle:
        return f"Not here — {idle}"
    reason = str(entry.get("reason", "")).strip()
    if switch in ON_OFF_SWITCHES:
        on = bool(entry.get("on"))
    elif switch == "checkpointing":
        mode = str(entry.get("mode", "none"))
        on = mode == "offloaded"
        if not on:
            return f"Off ({CHECKPOINT_WORDS.get(mode, mode)}) — {reason}" if reason else "Off"
    else:
        on = entry.get("mode") not in (None, "stock")
    who, rest = _who(reason, on, flipper)
    head = "On" if on else "Off"
    if who.startswith(f"{flipper} switched it off") and rest:  # the engine names what runs instead
        return f"{head} — {who}; instead: {rest}"
    if who and rest:
        return f"{head} — {who}: {rest}"
    return f"{head} — {who or rest}" if (who or rest) else head


def describe_plan(switch: str, value: Any, reason: str) -> str:
    """Before a run: what TuneDeck will choose for this GPU and model, and why."""
    if isinstance(value, bool):
        state = "on" if value else "off"
    elif switch == "checkpointing":
        state = "on" if value == "offloaded" else f"off ({CHECKPOINT_WORDS.get(str(value), value)})"
    elif switch == "moe_routing":
        state = "off" if value == "stock" else "on"
    else:
        state = str(value)
    head, _, tail = reason.partition(": ")
    rest = tail if tail and len(head.split()) <= 4 else reason  # "checkpointing off: why" -> "why"
    return f"Will be {state} — {rest}" if rest else f"Will be {state}"
