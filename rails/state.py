"""What the moderation rail remembers per engine, owned by the rail: kept beside the engine (a weak mapping), never
inside it, so the engine's attributes are only its own."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field


@dataclass
class RailState:
    suffixes: dict = field(default_factory=dict)      # question -> token ids closing the turn and asking it
    answers: dict = field(default_factory=dict)       # "Yes" / "No" -> their first token ids
    verdicts: dict = field(default_factory=dict)      # (turn, reply, user, settings) -> the verdict given
    probes: dict = field(default_factory=dict)        # question -> the loaded probe (or None)
    probe_files: dict = field(default_factory=dict)   # probe mode -> the file it names
    threshold_warned: set = field(default_factory=set)
    probe_warned: set = field(default_factory=set)
    strictness_warned: set = field(default_factory=set)   # (side, long): a probe without a strictness table, logged
    classifiers: dict = field(default_factory=dict)       # rail -> (the question classifier found, or None, where)
    classifier_files: dict = field(default_factory=dict)  # (classifier file a config names, rail) -> the classifier
    guard_checked: bool = False                           # guard.check passed for the engine's guard adapter
    lock: object = field(default_factory=threading.Lock)  # the memos above: a remote engine's calls run concurrently

    def forget_probes(self) -> None:
        """Drop what depends on where probes are looked for (tests move that folder)."""
        for memo in (self.probes, self.probe_files, self.probe_warned, self.strictness_warned, self.verdicts,
                     self.classifiers, self.classifier_files):
            memo.clear()
        self.guard_checked = False


_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def rail_state(engine) -> RailState:
    """The rail's state for ``engine`` (made at the first call)."""
    with _lock:
        state = _states.get(engine)
        if state is None:
            state = _states[engine] = RailState()
        return state
