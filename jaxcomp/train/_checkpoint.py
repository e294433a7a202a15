"""Orbax checkpoints of the whole training state, verified on restore, never lost to damage.

A checkpoint holds two items: ``state`` (every array: parameters, optimizer state, link and
transform states, the PRNG key) and ``meta`` (JSON: step, data position, counters, the
experiment's fingerprint, the metric accumulators, and a ``checksum``: one 32-bit
position-weighted sum per state leaf (of the arrays as handed to orbax), a digest of the
leaves' paths, shapes and dtypes, and a SHA-256 of the rest of ``meta``). Restoring with an
abstract target gives back the exact pytree structure (NamedTuples included) and shardings.

What the :class:`Checkpointer` guarantees:

* Restoring recomputes every checksum. A checkpoint with a damaged file (a flipped byte in any
  file orbax writes, a truncated or missing file) is moved to ``checkpoints.damaged/`` with a
  warning and the next older one is tried.
* A state holding NaN or Inf is never saved, so the newest checkpoint is always finite.
* Retention keeps the ``keep`` newest checkpoints and, whatever their number, the newest one
  known to be good (restored and verified, or read back and verified before anything older is
  deleted).
* A save left half-written by a crash, an abort or a lost peer (orbax's
  ``*.orbax-checkpoint-tmp*`` folders; the run does not wait for a save under way then) is
  removed when the workdir is opened again, never restored; opened again by the same process
  (a library user's restart), it is first waited for (:data:`ABANDONED_WAIT_S`) or the folder
  is refused naming it, never removed under its writer.
* A checkpoint's step is read from its own ``meta`` (covered by its checksum) and must match
  its folder's name: renamed or swapped step folders are refused, never restored under the
  wrong step (and retention, which runs only after a restore, never deletes the real state).
* A save that cannot be written stops the run: before it starts, when the disk has less room
  than the newest checkpoint took (or the folder is not writable); after it started, at the
  next step (:meth:`Checkpointer.failed_save`), the half-written folder removed. Either way
  one line names the folder and the bytes needed (no traceback: orbax's pending writes are
  cancelled before it closes their event loop), and the last good checkpoint stays.
* With several processes a write that fails on one of them (its disk full) stops every
  process at the next step: the failing process says why in the line above, the others name
  it and the cause. Orbax's own error comes back only after barriers that the processes still
  writing never pass (each waits at another one until orbax's timeout), so the failure is
  taken from orbax's error record as it is logged, and nothing waits on that save again.
  An error that stops every process while a save is under way (a metrics write failed) waits
  for it agreed, bounded (:data:`ERROR_EXIT_WAIT_S`), never in orbax's barriers.
* With several processes every verdict is agreed: a read-back that fails because another
  process is gone (a failed collective) raises :class:`~jaxcomp.train.PeerLost`; it never
  sets a good checkpoint aside as damaged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxcomp.train import _errors
from jaxcomp.train import _integrity
from jaxcomp.train import _metrics
from jaxcomp.train import _processes

log = logging.getLogger(__name__)

CHECKSUM = "checksum"  #: the meta key holding the checksums
LAYOUT = "layout"  #: the meta key listing every leaf's path, shape and dtype
DAMAGED = "checkpoints.damaged"  #: where damaged checkpoints are moved (beside ``checkpoints``)
_PARTIAL = ".orbax-checkpoint-tmp"
#: seconds a new :class:`Checkpointer` waits for a save that a run of this process left
#: behind in the same folder (stopped at once: a lost peer, an abort) before refusing the folder
ABANDONED_WAIT_S = 60.0
#: seconds an error exit with several processes waits for a save under way (agreed) before
#: leaving it to finish by itself (:meth:`Checkpointer.__exit__`)
ERROR_EXIT_WAIT_S = 60.0


async def _cancelling_the_rest(coro):
    """Runs ``coro``, then cancels the tasks it left in its event loop and waits for them.

    Orbax runs each part of a save in a fresh event loop that it closes as soon as the part
    ends (``asyncio_utils._run_sync_via_new_loop``); a part that fails on one write (a full
    disk) ends with its other writes still pending in tensorstore, whose completions then call
    ``call_soon_threadsafe`` on the closed loop: one ``RuntimeError: Event loop is closed``
    traceback each (dozens under a process's one error line). Cancelled here, inside the loop, a
    pending write's tensorstore future is cancelled too and calls back while the loop is open.
    A write that completed just before its cancel may still be calling back from tensorstore's
    thread (waiting for the GIL) when the loop closes: that call, for a task already ended,
    is dropped instead of raising.
    """
    loop = asyncio.get_running_loop()
    threadsafe = loop.call_soon_threadsafe

    def call_soon_threadsafe(callback, *args, context=None):
        try:
            return threadsafe(callback, *args, context=context)
        except RuntimeError:
            if loop.is_closed():  # nothing waits for it any more: every task ended
                return None
            raise

    loop.call_soon_threadsafe = call_soon_threadsafe
    try:
        return await coro
    finally:
        this = asyncio.current_task()
        while left := [t for t in asyncio.all_tasks() if t is not this]:  # and what they start
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)


def _close_orbax_loops_cleanly() -> bool:
    """Has orbax's event loops end their leftover tasks before closing; once per process.

    The tasks are cancelled by :func:`_cancelling_the_rest`. Orbax's private function is looked
    up where this orbax keeps it; ``False`` (only the tracebacks come back) where it moved:
    ``tests/train/test_checkpoint_faults.py`` checks it is found.
    """
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:
        return False
    run = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
    if run is None:
        return False
    if not getattr(run, "jaxcomp_cancels_the_rest", False):

        def run_sync_via_new_loop(coro):
            return run(_cancelling_the_rest(coro))

        run_sync_via_new_loop.jaxcomp_cancels_the_rest = True
        run_sync_via_new_loop.__wrapped__ = run
        asyncio_utils._run_sync_via_new_loop = run_sync_via_new_loop
    return True


class _LeftSave(threading.Thread):
    """Waits in the background for a save that a run stopping at once did not wait for, then
    closes its manager; a later :class:`Checkpointer` on the same folder waits for it
    (:func:`_wait_for_left_saves`). A daemon: it never holds the interpreter's exit."""

    def __init__(self, manager, directory: str, step: int, cause: str):
        super().__init__(name=f"jaxcomp-left-save-{step}", daemon=True)
        self.manager, self.directory, self.step, self.cause = manager, directory, step, cause

    def run(self) -> None:
        try:
            self.manager.wait_until_finished()
            self.manager.close()
        except Exception as e:  # noqa: BLE001 - orbax logged it; never restored half-written
            log.warning("a checkpoint save left by a stopped run failed: %s", _reason(e))


def _wait_for_left_saves(directory: str, wait_s: float) -> None:
    """Waits up to ``wait_s`` in all for the saves into ``directory`` that runs of this process
    left when they stopped at once (a library user calling the trainer again).

    Raises:
      WorkdirInUse: naming the save still being written after the wait.
    """
    deadline = time.monotonic() + wait_s
    for t in threading.enumerate():
        if isinstance(t, _LeftSave) and t.directory == directory:
            t.join(max(deadline - time.monotonic(), 0.0))
            if t.is_alive():
                raise _errors.WorkdirInUse(
                    f"checkpoint step {t.step} in {directory}, left by an earlier run of this "
                    f"process when it stopped at once ({t.cause}), is still being written after "
                    f"{wait_s:g} s: call again once it ends (it commits or fails by itself; "
                    "it is never restored half-written), or use another workdir."
                )


class DamagedCheckpoint(Exception):
    """A checkpoint whose files do not match its checksums."""


def _check_step(step: int, meta: dict, directory: str) -> None:
    """Refuses a checkpoint whose own (verified) step is not its folder's.

    Raises:
      CheckpointError: naming the folder and the step it holds.
    """
    held = meta.get("step")
    if held is not None and held != step:
        raise _errors.CheckpointError(
            f"checkpoint folder {os.path.join(directory, str(step))} holds step {held} (its "
            "own verified record): step folders were renamed or swapped. Move each back to "
            "the folder named for its step, or move them away to start over."
        )


def _disk_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


class _WriteErrors(logging.Filter):
    """Orbax's error records: each error is handed to ``seen`` (orbax logs a failed background
    write at once, from its writing thread); the records of a write that failed for lack of
    space or permission (each with a traceback, ~30 of them) are dropped: the
    :class:`Checkpointer` says it in one line."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            self.seen(error)
            text += f" {error} {error.__cause__ or ''} {error.__context__ or ''}"
        text = text.lower()
        return not any(k in text for k in ("resource_exhausted", "no space left", "permission"))


NO_SPACE = "no space left on the device"
READ_ONLY = "permission denied (read-only)"
VANISHED = "its folder vanished"
#: a failed write's cause as the code one process tells the others (0: none; 4: another error)
CAUSES = {NO_SPACE: 1, READ_ONLY: 2, VANISHED: 3}


def _why(e: BaseException) -> str:
    """A short cause of a failed write: ``no space left on the device``, ``permission
    denied``, or the error's first line."""
    text = str(e)
    low = text.lower()
    if "resource_exhausted" in low or "no space left" in low:
        return NO_SPACE
    if "permission denied" in low or "read-only" in low or isinstance(e, PermissionError):
        return READ_ONLY
    if isinstance(e, FileNotFoundError) or "no such file" in low:
        return VANISHED
    first = text.strip().splitlines()[0][:200] if text.strip() else ""
    return f"{type(e).__name__}: {first}"


def _warn(message: str) -> None:
    log.warning(message)
    if jax.process_index() == 0:
        print(f"WARNING: {message}", flush=True)


def _abstract(state: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def _layout_list(state: Any) -> list[list]:
    """``[path, shape, dtype]`` of every leaf (arrays or abstract ``ShapeDtypeStruct`` s)."""
    leaves = jax.tree.leaves(state)
    paths = _integrity.leaf_paths(state)
    return [[p, list(x.shape), str(x.dtype)] for p, x in zip(paths, leaves)]


def _layout(state: Any) -> str:
    return _integrity.json_digest(_layout_list(state))


def _layout_difference(saved: list | None, wanted: list) -> str:
    """The first leaf that differs between a saved layout and the one wanted, in words."""
    if not isinstance(saved, list):
        return "its arrays' paths, shapes or dtypes differ (saved before layouts were recorded)"
    have = {p: f"{d}{s}" for p, s, d in saved}
    want = {p: f"{d}{s}" for p, s, d in wanted}
    for path in [p for p, _, _ in wanted] + [p for p, _, _ in saved]:
        if have.get(path) != want.get(path):
            return (
                f"{path} is {have.get(path, 'absent')} in the checkpoint and "
                f"{want.get(path, 'absent')} in this run"
            )
    return "its leaves are in another order"


def _for_saving(state: Any) -> Any:
    """What orbax is handed to write: in a single process, host copies of every array.

    Fetched in one ``jax.device_get``, they are written as they are; a ``jax.Array`` with
    replicated shards would instead be cut into one slice per replica (orbax's replica-parallel
    saving, which compiles a ``slice`` program per leaf shape on the first save: ~1 s of a
    30-leaf state on 2 cores, useful only when several processes share the writing). Restoring
    is unchanged: the abstract target gives back ``jax.Array`` s with its shardings.
    """
    if jax.process_count() > 1:  # not every shard is addressable here
        return state
    leaves, treedef = jax.tree.flatten(state)
    fetch = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    for i, host in zip(fetch, jax.device_get([leaves[i] for i in fetch])):
        leaves[i] = host
    return jax.tree.unflatten(treedef, leaves)


def _verify(step: int, state: Any, meta: dict) -> None:
    """Raises :class:`DamagedCheckpoint` unless ``state`` and ``meta`` match their checksums."""
    check = meta.get(CHECKSUM)
    if check is None:
        _warn(
            f"checkpoint step {step} has no checksum (saved by an older jaxcomp); restored "
            "without verification."
        )
        return
    rest = {k: v for k, v in meta.items() if k != CHECKSUM}
    if not isinstance(check, dict) or _integrity.json_digest(rest) != check.get("meta"):
        raise DamagedCheckpoint("its metadata (meta/metadata) does not match its checksum")
    if state is None:
        return
    if _layout(state) != check.get("layout"):
        raise DamagedCheckpoint("its arrays' paths, shapes or dtypes differ from those saved")
    sums, _ = _integrity.inspect_state(state)
    saved = check.get("state")
    if not isinstance(saved, list) or len(saved) != len(sums):
        raise DamagedCheckpoint("its checksum list does not fit its arrays")
    wrong = [p for p, a, b in zip(_integrity.leaf_paths(state), sums, saved) if a != b]
    if wrong:
        raise DamagedCheckpoint(
            f"{len(wrong)} array(s) do not match their checksums: {', '.join(wrong[:3])}"
        )


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return text if isinstance(e, DamagedCheckpoint) else f"{type(e).__name__}: {text}"


class Checkpointer:
    """Saves, verifies and restores ``(state, meta)`` under ``workdir/checkpoints``.

    Args:
      workdir: the run directory.
      keep: how many recent checkpoints to keep (at least 2); the newest verified one is kept
        in addition when it is older.

    Example:
      >>> ckpt = Checkpointer(workdir)  # doctest: +SKIP
      >>> ckpt.save(10, state, {"step": 10})  # doctest: +SKIP
      >>> step, state, meta = ckpt.restore_latest(state)  # doctest: +SKIP
    """

    def __init__(self, workdir: str, keep: int = 2):
        self.workdir = os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, "checkpoints")
        self.keep = max(int(keep), 2)
        _wait_for_left_saves(self.directory, ABANDONED_WAIT_S)  # before removing its folder
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if _PARTIAL in name:  # a save that never finished (crash, abort)
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        _close_orbax_loops_cleanly()  # no tracebacks after a failed write
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        self._good: set[int] = set()  # steps read back and verified
        self._target: Any = None  # abstract state, for reading checkpoints back
        self._closed = False
        self._pending: tuple[int, int] | None = None  # (step, bytes) of a save under way
        self._failure: BaseException | None = None  # the pending save's error, as logged
        self._saves = self._waited = 0  # saves started / waited for (the same on every process)
        self._step = -1  # the step of the latest save
        #: steps whose saves may have written since the workdir was last found intact (a save
        #: seen finished before that check wrote into it): into a recreated workdir, if it was
        #: lost meanwhile; a set updated in place (see :meth:`workdir_intact`)
        self.in_flight: set[int] = set()
        self._ended: set[int] = set()  # of those, the saves seen finished (or failed)
        self.stuck = False  #: a save failed with several processes: orbax's threads never end
        self.cause = ""  #: the cause of the last failed save (``NO_SPACE``, ...), if any
        self.processes = jax.process_count()  #: the run's processes (a read-back's peers)
        self._quiet = _WriteErrors(self._seen)
        # first: a filter that drops a record ends the chain (another Checkpointer's, open in
        # this process, would keep this one from seeing its own save's error)
        logging.getLogger("absl").filters.insert(0, self._quiet)

    def _seen(self, error: BaseException) -> None:
        """Keeps the first error orbax logs while a save is under way (not that of a failed
        collective: a lost peer is reported as such)."""
        if self._pending is not None and self._failure is None:
            if not _processes.is_peer_failure(error, self.processes):
                self._failure = error

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> bool:
        """Saves ``state`` (asynchronously) with ``meta`` and their checksums.

        Returns:
          ``False`` (with a warning, nothing written) if ``state`` holds NaN or Inf.
        """
        to_write = _for_saving(state)
        sums, bad = _integrity.inspect_state(to_write)  # the arrays as written
        if bad:
            newest = self.all_steps()[-1:] or ["none"]
            _warn(
                f"the state at step {step} holds NaN or Inf (in {', '.join(bad[:3])}); not "
                f"checkpointed: the newest checkpoint stays the last finite one ({newest[0]})."
            )
            return False
        if self._target is None:
            self._target = _abstract(state)
        self.wait()
        self._prune(room=1)
        need = self._expected_bytes(to_write)
        self._step = step
        problem = self._room_for(step, need)
        self._agree(step, problem, busy=False)  # one verdict for all
        rest = {k: v for k, v in meta.items() if k != CHECKSUM}
        rest = json.loads(json.dumps({**rest, LAYOUT: _layout_list(state)}))
        check = {"state": sums, "layout": _layout(state), "meta": _integrity.json_digest(rest)}
        self._pending, self._failure = (step, need), None  # before: orbax may fail at once
        self.in_flight.add(step)
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(to_write),
                    meta=ocp.args.JsonSave({**rest, CHECKSUM: check}),
                ),
                force=True,
            )
        except BaseException:
            self._pending = None
            raise
        self._saves += 1
        return True

    def _expected_bytes(self, state: Any) -> int:
        """What the next checkpoint will take on disk: the newest one's size, or (for a
        first save) twice the state's bytes (orbax's files add little to large arrays)."""
        steps = self.all_steps()
        if steps:
            size = _disk_bytes(os.path.join(self.directory, str(steps[-1])))
            if size:
                return size
        return 2 * sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state)) + 2**16

    def _room_for(self, step: int, need: int) -> str | None:
        """Why checkpoint ``step`` cannot be written here (``None`` if it can)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            fs = os.statvfs(self.directory)
        except OSError as e:
            return self._write_failure(step, need, _why(e))
        if not os.access(self.directory, os.W_OK | os.X_OK):
            return self._write_failure(step, need, "permission denied (read-only)")
        if fs.f_bavail * fs.f_frsize < need:
            return self._write_failure(step, need, "no space left on the device")
        return None

    def _write_failure(self, step: int, need: int, why: str) -> str:
        self.cause = why
        try:
            fs = os.statvfs(self.directory)
            free = f", {_metrics.format_bytes(fs.f_bavail * fs.f_frsize)} free"
        except OSError:
            free = ""
        good = [s for s in self.all_steps() if s != step]
        kept = (
            f"the last good checkpoint (step {good[-1]}) is intact"
            if good
            else "no earlier checkpoint exists"
        )
        return (
            f"checkpoint step {step} cannot be written to {self.directory}: {why} (it needs "
            f"about {_metrics.format_bytes(need)}{free}); {kept}. Fix that and run the same "
            "command to resume."
        )

    def _agree(self, step: int, problem: str | None, busy: bool, late: bool = False) -> bool:
        """One collective: whether any process's save of ``step`` failed (``problem``: its
        line here, :attr:`cause` set), is still ``busy``, or was waited for past a bound
        (``late``).

        Returns:
          Whether a process is still busy.

        Raises:
          StorageError: this process's ``problem``, or the line naming the process that has one
            and its cause, or (with no problem anywhere) the line saying that the save was
            still being written past the bound on some process.
        """
        flags = [0 if problem is None else self.cause_code(), busy, late]
        codes = _processes.gather_ints(flags)
        if problem is None and codes[:, 0].any():
            k = int(codes[:, 0].nonzero()[0][0])
            raise _errors.StorageError(self.failed_elsewhere(k, int(codes[k, 0])))
        if problem is not None:
            raise _errors.StorageError(problem)
        if codes[:, 2].any():
            k = int(codes[:, 2].nonzero()[0][0])
            raise _errors.StorageError(
                f"checkpoint step {step} was still being written after {ERROR_EXIT_WAIT_S:g} s "
                f"(process {k}); left to finish by itself, never restored half-written."
            )
        return bool(codes[:, 1].any())

    def cause_code(self) -> int:
        """:attr:`cause` as the code one process tells the others (1-4)."""
        return CAUSES.get(self.cause, len(CAUSES) + 1)

    def failed_elsewhere(self, k: int, code: int) -> str:
        """The line of a process whose peer ``k`` could not write the checkpoint under way
        (``code``: :meth:`cause_code` there); nothing waits on that save any more."""
        self.cause = {v: c for c, v in CAUSES.items()}.get(code, "an error (see its output)")
        self.stuck = self.processes > 1
        return (
            f"process {k} cannot write checkpoint step {self._step}: {self.cause} (its "
            "output names the path and the bytes needed); this process stops with it. The "
            "last good checkpoint is intact: fix that and run the same command to resume."
        )

    def failed_save(self) -> str | None:
        """``None`` unless the last save failed in the background (then the line that says
        so, once its half-written folder is removed); never waits for a save under way.

        With several processes a failure is seen as soon as orbax logs it, before orbax's
        thread ends (it never does: see the module's docstring), and :attr:`stuck` is set.
        """
        if self._pending is None:
            return None
        error = self._failure if self.processes > 1 else None  # one process: orbax's ends
        if error is None:
            if self.manager.is_saving_in_progress():
                return None
            try:  # finished: neither waits; the writer's error is re-raised by one or other
                self.manager.wait_until_finished()
                self.manager.check_for_errors()
            except Exception as e:  # noqa: BLE001 - reported as one line
                error = e
        step, need = self._pending
        self._pending, self._failure = None, None
        self._ended.add(step)
        if error is None:
            return None
        self.stuck = self.processes > 1
        self.cause = _why(error)
        line = self._write_failure(step, need, self.cause)  # the room left before the removal
        self._remove_partial()
        return line

    def _remove_partial(self) -> None:
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if _PARTIAL in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def workdir_intact(self) -> None:
        """Tells that the workdir was just found to be the run's own: the saves seen ended
        before wrote into it, and leave :attr:`in_flight`."""
        self.in_flight -= self._ended
        self._ended.clear()

    def prepare(self, state: Any) -> None:
        """Runs the checksum pass once on ``state``, compiling what it needs.

        Called before the first training step, so that the first save (or a read-back before
        pruning) compiles nothing in the middle of the run: the jitted pass of the leaves
        sharded across processes, and the PRNG keys' ``key_data`` (the other leaves are summed
        on the host); a state of other shapes or shardings still works, compiling its own
        programs when first saved.
        """
        if self._target is None:
            self._target = _abstract(state)
        _integrity.inspect_state(state)

    def wait(self) -> None:
        """Waits for a save under way.

        With several processes, every process waits until the save is done on all of them or
        has failed on one of them (one small collective every 50 ms): a process whose write
        failed never passes orbax's barriers, so waiting on orbax alone would hang the others.

        Raises:
          StorageError: if it failed here (one line; its half-written folder removed) or on
            another process (the line names it).
        """
        if self.processes > 1 and self._waited != self._saves:
            while self._agree(
                self._step,
                self.failed_save() if self._failure else None,
                busy=self.manager.is_saving_in_progress(),
            ):
                time.sleep(0.05)
            self._waited = self._saves
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax re-raises the writer's error
            if self._pending is None:
                raise
            step, need = self._pending
            self._pending = None
            self._ended.add(step)
            self._remove_partial()
            raise _errors.StorageError(self._write_failure(step, need, _why(e))) from e
        problem = self.failed_save()
        if problem:
            raise _errors.StorageError(problem)

    def read_meta(self, step: int) -> dict:
        """The verified ``meta`` of ``step``.

        Raises:
          DamagedCheckpoint: if it does not match its checksum (other errors if unreadable).
        """
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(out["meta"])
        _verify(step, None, meta)
        _check_step(step, meta, self.directory)
        return meta

    def latest_meta(self) -> tuple[int, dict] | None:
        """``(step, meta)`` of the newest checkpoint whose ``meta`` reads and verifies."""
        for step in reversed(self.all_steps()):
            try:
                return step, self.read_meta(step)
            except _errors.CheckpointError:
                raise
            except Exception:  # damage is reported when the state is restored
                continue
        return None

    def _restore(self, step: int, target: Any) -> tuple[Any, dict]:
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        meta = dict(out["meta"])
        _verify(step, out["state"], meta)
        _check_step(step, meta, self.directory)
        return out["state"], meta

    def _check_layout(self, step: int) -> None:
        """Refuses a checkpoint whose verified record says it holds another state layout
        (the model, mode, codec or jaxcomp changed what a state holds): that is not damage,
        and it is not set aside.

        Raises:
          CheckpointError: naming the first leaf that differs.
        """
        try:
            meta = self.read_meta(step)
        except _errors.CheckpointError:
            raise
        except Exception:  # noqa: BLE001 - damage: reported when the state is read
            return
        check = meta.get(CHECKSUM)
        if not isinstance(check, dict) or check.get("layout") in (None, _layout(self._target)):
            return
        wanted = _layout_list(self._target)
        raise _errors.CheckpointError(
            f"checkpoint step {step} in {self.directory} holds a state of another layout: "
            f"{_layout_difference(meta.get(LAYOUT), wanted)}. The model, mode, codec or "
            "jaxcomp version changed what a run saves; resume it with what wrote it, or use a "
            "new --workdir."
        )

    def _verdict(self, step: int) -> tuple[Any, dict] | Exception:
        """Reads ``step`` back: ``(state, meta)``, or the error that says it is damaged.

        Raises:
          CheckpointError: for a step folder holding another step, or another layout.
          PeerLost: when the read failed because another process is gone (not damage).
        """
        self._check_layout(step)
        try:
            return self._restore(step, self._target)
        except _errors.CheckpointError:
            raise
        except Exception as e:  # orbax raises many kinds for damaged files
            if _processes.is_peer_failure(e, self.processes):
                raise _errors.PeerLost(
                    f"reading checkpoint step {step} back failed because another process is "
                    f"gone ({_reason(e)}); the checkpoint was left in place."
                ) from e
            return e

    def _agreed_damage(self, step: int, error: Exception | None) -> Exception | None:
        """Whether every process finds ``step`` good: one process's damage is everyone's
        (the folder is shared); a failed agreement (a process gone) raises ``PeerLost``."""
        try:
            flags = _processes.gather_ints([error is not None])[:, 0]
        except Exception as e:
            if _processes.is_peer_failure(e, self.processes):
                raise _errors.PeerLost(
                    f"agreeing on checkpoint step {step} failed because another process is "
                    f"gone ({_reason(e)}); the checkpoint was left in place."
                ) from e
            raise
        if error is None and flags.any():
            bad = [int(i) for i in flags.nonzero()[0]]
            return DamagedCheckpoint(f"process(es) {bad} read it back damaged")
        return error

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """Restores the newest checkpoint that verifies; ``None`` if there is none.

        A damaged step (unreadable, or not matching its checksums) is reported, then moved to
        ``checkpoints.damaged/`` once an older step restores.

        Raises:
          CheckpointError: if checkpoints exist but none can be restored.
        """
        steps = self.all_steps()
        if not steps:
            return None
        self._target = _abstract(abstract_state)
        damaged = []
        for step in reversed(steps):
            got = self._verdict(step)
            e = self._agreed_damage(step, got if isinstance(got, Exception) else None)
            if e is not None:
                damaged.append((step, _reason(e)))
                _warn(
                    f"checkpoint step {step} in {self.directory} is damaged ({_reason(e)}); "
                    "falling back to an older one."
                )
                continue
            state, meta = got
            self._good.add(step)
            if damaged:
                self._set_aside([s for s, _ in damaged])
                _warn(
                    f"resumed from the older checkpoint step {step}; the damaged one(s) were "
                    f"moved to {os.path.join(self.workdir, DAMAGED)}."
                )
            return step, state, meta
        raise _errors.CheckpointError(
            f"no checkpoint in {self.directory} can be restored ("
            + "; ".join(f"step {s}: {r}" for s, r in damaged)
            + "); move the folder away to start over."
        )

    def _set_aside(self, steps: list[int]) -> None:
        if not steps:
            return
        if jax.process_index() == 0:
            aside = os.path.join(self.workdir, DAMAGED)
            os.makedirs(aside, exist_ok=True)
            for step in steps:
                dest, n = os.path.join(aside, str(step)), 1
                while os.path.exists(dest):
                    dest, n = os.path.join(aside, f"{step}-{n}"), n + 1
                shutil.move(os.path.join(self.directory, str(step)), dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxcomp_checkpoint_set_aside")
        self.manager.reload()

    def _newest_good(self) -> int | None:
        """The newest step that verifies (read back if not yet); damaged newer ones set aside."""
        damaged, good = [], None
        for step in reversed(self.all_steps()):
            if step in self._good:
                good = step
                break
            got = self._verdict(step)
            e = self._agreed_damage(step, got if isinstance(got, Exception) else None)
            if e is not None:
                _warn(f"checkpoint step {step} reads back damaged ({_reason(e)}); moving it away.")
                damaged.append(step)
                continue
            self._good.add(step)
            good = step
            break
        self._set_aside(damaged)
        return good

    def _prune(self, room: int) -> None:
        """Deletes all but the ``keep - room`` newest steps and the newest verified one."""
        if len(self.all_steps()) <= self.keep - room or self._target is None:
            return
        good = self._newest_good()
        if good is None:  # nothing verifies: delete nothing
            return
        steps = self.all_steps()
        keep = set(steps[len(steps) - (self.keep - room) :]) | {good}
        for step in steps:
            if step not in keep:
                self.manager.delete(step)
                self._good.discard(step)

    def close(self) -> None:
        """Waits for pending saves, applies retention and closes the manager (once)."""
        if self._closed:
            return
        self.wait()
        self._prune(room=0)
        self.manager.close()
        self._closed = True
        logging.getLogger("absl").removeFilter(self._quiet)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, error, tb) -> None:
        """After an error: lets pending saves finish, then closes (no retention).

        After a lost peer (:class:`~jaxcomp.train.PeerLost`), a write failed with several
        processes, or an abort (``KeyboardInterrupt``, :class:`~jaxcomp.train.Aborted`):
        leaves at once, without waiting for a save under way (it may wait on the lost process;
        an abort asks to stop now). Such a save stays in orbax's temporary folder until it
        commits by itself: never restored, removed by the next start, no checkpoint set aside
        (the CLI exits at once, so it does not commit there). In a program that goes on, a
        later Checkpointer on the same folder waits for it (:data:`ABANDONED_WAIT_S`), then
        refuses the folder naming it, so a restart in the same process never removes or
        resumes a folder under its writer.

        With several processes no error waits on orbax without a bound: a
        :class:`~jaxcomp.train.StorageError` (met by every process at the same step) waits for
        the save under way with the agreement of :meth:`wait` (its write may fail meanwhile on
        one process, whose peers would wait in orbax's barriers until orbax's timeout), at most
        :data:`ERROR_EXIT_WAIT_S`, and leaves at once once a process failed; any other error
        (perhaps this process's alone: no collective) leaves a save under way at once."""
        if self._closed or kind is None:
            return
        at_once = not issubclass(kind, Exception) or issubclass(kind, _errors.PeerLost)
        self._closed = True
        try:  # the filter stays while waiting: a failure seen here is this exit's, said once
            if not (at_once or self.stuck) and (
                self.processes == 1
                or self._waited == self._saves  # nothing started since every process waited
                or (issubclass(kind, _errors.StorageError) and self._agreed_end())
            ):
                self._close_after_error()
            elif self.manager.is_saving_in_progress():  # waits on a lost process, a failed write
                step = self._pending[0] if self._pending else self._step
                _LeftSave(self.manager, self.directory, step, kind.__name__).start()
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)

    def _agreed_end(self) -> bool:
        """Whether the save under way ended on every process (with several processes, after an
        error they all met): agreed every 50 ms, for at most :data:`ERROR_EXIT_WAIT_S`."""
        deadline = time.monotonic() + ERROR_EXIT_WAIT_S
        try:
            while self._agree(
                self._step,
                self.failed_save() if self._failure else None,
                busy=self.manager.is_saving_in_progress(),
                late=time.monotonic() > deadline,
            ):
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the error that ends the run is the one to report
            return False
        self._waited = self._saves
        return True

    def _close_after_error(self) -> None:
        try:  # the error that ends the run is the one to report, not a save's after it
            self.manager.wait_until_finished()
            self.manager.close()
        except Exception as e:  # noqa: BLE001
            log.warning("while closing checkpoints after an error: %s", _reason(e))
            self._remove_partial()
