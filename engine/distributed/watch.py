"""Noticing a node that is gone: heartbeats through the rendezvous store, and one verdict that names the node.

The ranks of a run over several computers wait for each other inside collectives that have no useful timeout (a
pause keeps them waiting for days), and a computer that loses power or its cable closes no connection. So every
rank runs a :class:`NodeWatch` thread beside its training: each ``interval`` it bumps its own counter in the
rendezvous store and reads every other rank's. A rank of another node whose counter has not moved for
``training.node_timeout`` seconds, or a store that stops answering, is a verdict ("node 1 stopped answering for
30 s: ..."); the watch prints it and ends the process, which ends the run on this node within
``node_timeout + interval`` seconds of the last sign of life. A rank that fails on its own posts its reason first,
so the others name it. Only node 0 writes the run folder, and checkpoints are written whole or not at all
(engine.run.checkpoint), so the last checkpoint survives however the process ends.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.distributed.nodes import LOST_MARK, RUN_ID, Place

LOST_EXIT = 4
BEAT_S = 1.0


class NodeWatch:
    """A daemon thread watching the other nodes' ranks; :meth:`verdict` says who went, once someone has."""

    def __init__(
        self,
        store: Any,
        place: Place,
        timeout_s: float,
        on_lost: Callable[[str], None] | None = None,
        interval_s: float = BEAT_S,
    ) -> None:
        self.store = store
        self.place = place
        self.timeout_s = timeout_s
        self.interval_s = min(interval_s, timeout_s / 3)
        self.on_lost = on_lost or exit_with
        self._verdict: str | None = None
        self._deciding = threading.Lock()
        self._found = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tunedeck-node-watch", daemon=True)
        self._guard = threading.Thread(target=self._guard_loop, name="tunedeck-node-watch-guard", daemon=True)
        self._answered = time.monotonic()

    def start(self) -> None:
        self._thread.start()
        self._guard.start()

    def close(self) -> None:
        """This rank is done: say so, so that nobody takes its silence for a loss, and stop watching."""
        self._done.set()
        with contextlib.suppress(Exception):
            self.store.set(f"{RUN_ID}/done/{self.place.rank}", "1")
        self._thread.join(timeout=self.interval_s * 3)

    def post_failure(self, reason: str) -> None:
        """This rank is failing with ``reason``; the other nodes will name it."""
        with contextlib.suppress(Exception):
            self.store.set(f"{RUN_ID}/gone/{self.place.node}", reason)

    def verdict(self, wait_s: float = 0.0) -> str | None:
        """Who went and why, waiting up to ``wait_s`` for the watch to decide."""
        self._found.wait(wait_s)
        return self._verdict

    def _others(self) -> list[int]:
        return [r for r, node in enumerate(self.place.node_of_rank) if node != self.place.node]

    def _loop(self) -> None:
        seen = {rank: (-1, time.monotonic()) for rank in self._others()}
        while not self._done.wait(self.interval_s):
            try:
                self.store.add(f"{RUN_ID}/beat/{self.place.rank}", 1)
                verdict = self._silent(seen) or self._posted()
                self._answered = time.monotonic()
            except Exception as err:  # the store (on the first node) is unreachable
                verdict = self._store_lost(str(err).strip().splitlines()[0] if str(err).strip() else repr(err))
            if verdict and not self._done.is_set():
                self._decide(verdict)
                return

    def _guard_loop(self) -> None:
        """A store call on a connection whose cable was pulled may never return: past the timeout, that is a verdict."""
        while not self._done.wait(self.interval_s):
            silent = time.monotonic() - self._answered
            if silent > self.timeout_s + self.interval_s and not self._found.is_set():
                self._decide(self._store_lost(f"no answer for {silent:.0f} s"))
                return

    def _silent(self, seen: dict[int, tuple[int, float]]) -> str | None:
        now = time.monotonic()
        for rank, (count, since) in seen.items():
            current = self.store.add(f"{RUN_ID}/beat/{rank}", 0)
            if current != count:
                seen[rank] = (current, now)
            elif now - since > self.timeout_s and not self.store.check([f"{RUN_ID}/done/{rank}"]):
                node = self.place.node_of_rank[rank]
                return (
                    f"node {node} stopped answering for {self.timeout_s:.0f} s (it was stopped, crashed, "
                    "or lost the network)"
                )
        return None

    def _posted(self) -> str | None:
        for node in sorted(set(self.place.node_of_rank) - {self.place.node}):
            key = f"{RUN_ID}/gone/{node}"
            if self.store.check([key]):
                return f"node {node} stopped: {self.store.get(key).decode()}"
        return None

    def _store_lost(self, why: str) -> str:
        others = sorted(set(self.place.node_of_rank) - {self.place.node})
        who = f"node {others[0]}" if len(others) == 1 else "the other nodes"
        return f"lost the connection to {who} (the rendezvous store stopped answering: {why})"

    def _decide(self, verdict: str) -> None:
        with self._deciding:
            if self._verdict is not None:
                return
            self._verdict = verdict
        self.on_lost(LOST_MARK + verdict)  # by default the process ends here
        self._found.set()


def exit_with(line: str) -> None:
    """End this process at once with ``line`` on stderr: its training thread may be stuck in a collective."""
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)
    os._exit(LOST_EXIT)
