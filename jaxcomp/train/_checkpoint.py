"""Orbax checkpoints of the whole training state, with a fallback past a corrupted step.

A checkpoint holds two items: ``state`` (every array: parameters, optimizer state, link and
transform states, the PRNG key) and ``meta`` (JSON: step, data position, non-finite counters,
the experiment fingerprint). Restoring with an abstract target gives back the exact pytree
structure (NamedTuples included) and shardings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores ``(state, meta)`` under ``workdir/checkpoints``.

    Args:
      workdir: the run directory.
      keep: how many recent checkpoints to keep (at least 2, so a corrupted latest one can fall
        back to its predecessor).
    """

    def __init__(self, workdir: str, keep: int = 2):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=max(int(keep), 2), create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """Restores the newest readable checkpoint; ``None`` if there is none.

        A step that fails to restore (a truncated or corrupted save) is skipped with a warning
        and the next older one is tried.

        Raises:
          RuntimeError: if checkpoints exist but none can be restored.
        """
        steps = self.all_steps()
        if not steps:
            return None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        errors = []
        for step in reversed(steps):
            try:
                out = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                    ),
                )
                for bad, _ in errors:  # newer, unreadable: drop them so the run can re-save
                    self.manager.delete(bad)
                if errors:
                    log.warning("resumed from older checkpoint step %d instead.", step)
                return step, out["state"], dict(out["meta"])
            except Exception as e:  # orbax raises many kinds for damaged files
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log.warning(
                    "checkpoint step %d in %s is unreadable (%s); falling back.",
                    step,
                    self.directory,
                    msg,
                )
                print(
                    f"WARNING: checkpoint step {step} is unreadable ({msg}); "
                    "falling back to an older one.",
                    flush=True,
                )
                errors.append((step, msg))
        raise RuntimeError(f"no checkpoint in {self.directory} could be restored: {errors}")

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
