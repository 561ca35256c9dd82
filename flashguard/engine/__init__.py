"""Engine: model loading, the decode loop, sampling, per-task stats, one engine per process."""

from .engine import Delta, Engine, Turn
from .registry import get_engine
from .sampling import SamplingParams

__all__ = ["Delta", "Engine", "Turn", "SamplingParams", "get_engine"]
