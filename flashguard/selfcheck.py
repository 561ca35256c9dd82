"""Once-per-GPU self-checks of optional kernels (the Triton ones): a kernel that does not build, does not run or
disagrees with its reference on a device is reported once, and its callers take their fallback there.

Contract: ``check = SelfCheck(what, probe, fallback)``; ``check(device)`` is True when ``probe(device)`` returned
True on that CUDA device (run once per device, the result kept); an exception or False is logged once, with
``what`` and ``fallback``, and ``check.last_error`` says why. Any other device type is False. ``give_up(device, exc)``
turns the check False on a device where the kernel later failed in use.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("flashguard")


class SelfCheck:
    def __init__(self, what: str, probe: Callable[[torch.device], bool], fallback: str):
        self.what, self.probe, self.fallback = what, probe, fallback
        self.results: dict[int, bool] = {}
        self.last_error = ""

    def __call__(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.results:
            try:
                with torch.cuda.device(index):
                    ok = bool(self.probe(torch.device("cuda", index)))
                if not ok:
                    self.last_error = "wrong results in the self-check"
                    log.warning("flashguard: %s returned wrong results; %s", self.what, self.fallback)
            except Exception as exc:  # no Triton, no UVA, an unsupported GPU: the fallback works everywhere
                ok, self.last_error = False, f"{type(exc).__name__}: {exc}"
                log.info("flashguard: %s unavailable (%s); %s", self.what, self.last_error, self.fallback)
            self.results[index] = ok
        return self.results[index]

    def give_up(self, device: torch.device, exc: Exception) -> None:
        """The kernel failed in use on ``device`` (a case its probe did not try): the fallback from now on, said once."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if self.results.get(index, True):
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("flashguard: %s failed (%s); %s", self.what, self.last_error, self.fallback)
        self.results[index] = False
