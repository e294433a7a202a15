"""The trainer's reader of a pipeline step's ``cold_sends``: one warning line per run."""

from __future__ import annotations

from typing import Any

import numpy as np


class ColdSendWatch:
    """Host-side reader of a step's ``cold_sends`` (per-sample sends that met a buffer their
    replica never filled): one warning line per run when a step whose every sample was trained
    before (on some replica) still met cold buffers. A first visit is cold by design; a
    revisit is cold only when the sample went to another replica than the one keeping its
    buffers, or its id is keyed wrongly, and AQ-SGD then sends plain compression.

    Example:
      >>> watch = ColdSendWatch()
      >>> watch.see(np.array([0, 1]), {"cold_sends": 2.0}, 1)  # first visits: expected
      >>> watch.see(np.array([1, 0]), {"cold_sends": 2.0}, 2)[:30]
      'step 2: 2 per-sample sends met'
    """

    def __init__(self):
        self.trained = np.zeros(0, bool)
        self.warned = False

    def see(self, ids: Any, metrics: dict, step: int) -> str | None:
        """Records the step's ``ids``; returns the warning line (once per run) or ``None``."""
        if ids is None:
            return None
        ids = np.asarray(ids).reshape(-1)
        ids = ids[ids >= 0]
        cold = float(metrics.get("cold_sends", 0.0))
        line = None
        if ids.size and ids.max() >= self.trained.size:
            grown = np.zeros(max(2 * self.trained.size, int(ids.max()) + 1), bool)
            grown[: self.trained.size] = self.trained
            self.trained = grown
        if cold > 0 and not self.warned and ids.size and self.trained[ids].all():
            self.warned = True
            line = (
                f"step {step}: {cold:g} per-sample sends met a cold buffer although every sample "
                "of the step was trained before: samples fed to another data replica than the "
                "one that keeps their buffers, or sample ids that do not name the samples "
                "(AQ-SGD then sends plain compression; logged as cold_sends; warned once)."
            )
        self.trained[ids] = True
        return line
