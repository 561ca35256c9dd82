"""Cumulative counters by task (``generation``, ``moderation``), read by ``flashguard.engine_stats()``."""

from __future__ import annotations

import threading
from dataclasses import dataclass

TASKS = ("generation", "moderation")


@dataclass
class TaskStats:
    calls: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    fallbacks: int = 0  # moderation: turns whose pages were gone, so the conversation was prefilled again
    server_seconds: float = 0.0   # backend openai: the server's own time for the calls (its timings), part of seconds

    def as_dict(self) -> dict:
        """The counters, seconds to the millisecond (``/stats``, the server's memory report)."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class EngineStats:
    """Cumulative ``TaskStats`` per task, and ``last[task]``: the figures of that task's most recent call
    (prompt / prefilled / reused / generated tokens, seconds, first_token_s: the time to its first token,
    l3_reads: pages read from disk during the call; server_seconds: a serving engine's own time for it, from its
    ``timings``, 0 where it reports none) for benchmarks and ``/stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks = {t: TaskStats() for t in TASKS}
        self.last: dict[str, dict] = {}

    def record(self, task: str, *, prompt: int, prefilled: int, reused: int, generated: int, seconds: float,
               fallback: bool = False, first_token_s: float | None = None,
               l3_reads: int = 0, server_seconds: float = 0.0) -> None:
        with self._lock:
            self.last[task] = {"prompt": prompt, "prefilled": prefilled, "reused": reused, "generated": generated,
                               "seconds": seconds, "first_token_s": first_token_s, "l3_reads": l3_reads,
                               "server_seconds": server_seconds}
            s = self._tasks.setdefault(task, TaskStats())
            s.calls += 1
            s.prompt_tokens += prompt
            s.prefilled_tokens += prefilled
            s.reused_tokens += reused
            s.generated_tokens += generated
            s.seconds += seconds
            s.server_seconds += server_seconds
            s.fallbacks += int(fallback)

    def as_dict(self) -> dict:
        with self._lock:
            return {t: s.as_dict() for t, s in self._tasks.items()}
