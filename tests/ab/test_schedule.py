"""AB-Training schedule: phases and LR rebound vs transcriptions of the reference trainer."""

import numpy as np
import optax
import pytest

from jaxcomp.transforms import ABPhase
from jaxcomp.transforms import ABSchedule

W, A, F = ABPhase.WARMUP, ABPhase.AB, ABPhase.FULL


def reference_phases(warmup, every, full, steps):
    """``ABLowRankTrainer._post_train_step`` (SPEC §3.5): the mode of each step index."""
    mode, switches, out = ("warmup" if warmup else "ab"), [], []
    for t in range(steps):
        out.append({"warmup": W, "ab": A, "full": F}[mode])
        n = t + 1  # total_train_iterations after the step
        if n < warmup:
            continue
        if n == warmup:
            new = "ab"
        elif n % every == 0 and n > warmup:
            new = "full"
        elif n > every and n % every == full:
            new = "ab"  # change_ab_train_mode is a no-op when already in "ab"
        else:
            continue
        if new != mode:
            switches.append(n)
        mode = new
    return out, switches


CASES = [(5, 4, 1), (8, 4, 2), (0, 5, 2), (3, 6, 2), (10, 7, 3)]


@pytest.mark.parametrize("warmup,every,full", CASES)
def test_phases_match_the_reference_state_machine(warmup, every, full):
    s = ABSchedule(warmup, every, full)
    expected, switches = reference_phases(warmup, every, full, 60)
    assert [int(s.phase(t)) for t in range(60)] == expected
    starts = sorted({int(s.last_switch(t)) for t in range(61)} - {-1})
    assert starts == [n for n in switches if n <= 60]


def test_a_no_op_switch_inside_the_first_ab_phase_is_not_a_switch():
    # warmup % S = 1 <= D = 2: the reference re-enters "ab" at t = 6 while already in it.
    s = ABSchedule(warmup_steps=5, sync_every=4, full_rank_steps=2)
    assert [int(s.phase(t)) for t in range(5, 11)] == [A, A, A, F, F, A]
    assert int(s.last_switch(7)) == 5


def test_step_kinds():
    s = ABSchedule(warmup_steps=2, sync_every=4, full_rank_steps=1)
    kinds = [s.step_kind(t) for t in range(10)]
    assert kinds == ["dense", "dense", "ab", "ab_then_sync", "dense_then_refactor", "ab", "ab",
                     "ab_then_sync", "dense_then_refactor", "ab"]  # fmt: skip


@pytest.mark.parametrize("warmup,every,full", [*CASES, (1, 2, 1), (4, 2, 1)])
def test_step_kind_on_the_host_agrees_with_the_traced_phase(warmup, every, full):
    # step_kind runs on the host every step (no device dispatch): it must agree with the
    # traceable phase() at every count, near 2**31 too, and refuse what is not an int
    s = ABSchedule(warmup, every, full)
    big = 2**31 - 3 * every
    for t in [*range(3 * every + warmup + 2), *range(big, big + 2 * every)]:
        now, nxt = int(s.phase(np.int64(t))), int(s.phase(np.int64(t) + 1))
        assert s.phase_of(t) == s.phase_of(np.int32(t)) == now
        kind = s.step_kind(t)
        if now == A:
            assert kind == ("ab_then_sync" if nxt == F else "ab")
        else:
            assert kind == ("dense_then_refactor" if (now, nxt) == (F, A) else "dense")
    for bad in (1.5, "3", None):
        with pytest.raises(TypeError):
            s.step_kind(bad)
    with pytest.raises(ValueError, match="count"):
        s.step_kind(-1)


def reference_rebound(base, schedule, rebound_steps, floor, steps):
    """``_setup_lr_rebound`` / ``_pre_forward`` with a per-update scheduler (``step_update``)."""
    _, switches = reference_phases(
        schedule.warmup_steps, schedule.sync_every, schedule.full_rank_steps, steps
    )
    lr, k, factor, active, used = base(0), 0, 0.0, False, []
    for t in range(steps):
        if active:  # _pre_forward
            k += 1
            new = factor * k
            if new < lr:
                lr = new
            if k >= rebound_steps:
                active = False
        used.append(lr)
        lr = base(t + 1)  # lr_scheduler.step_update
        if t + 1 in switches:  # _post_train_step -> _setup_lr_rebound
            factor, lr, k, active = (lr - floor) / rebound_steps, floor, 0, True
    return np.array(used)


def test_lr_rebound_matches_the_reference():
    s = ABSchedule(warmup_steps=6, sync_every=10, full_rank_steps=3)
    base = optax.cosine_decay_schedule(3e-3, 60, alpha=0.5)
    ours = s.learning_rate(base, rebound_steps=4, floor=1e-5)
    got = np.array([float(ours(t)) for t in range(60)])
    want = reference_rebound(lambda t: float(base(t)), s, 4, 1e-5, 60)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[6] == pytest.approx(1e-5) and got[10] == pytest.approx(1e-5)  # switches
    mult = s.rebound_multiplier(base, 4, 1e-5)
    np.testing.assert_allclose([float(mult(t)) for t in (6, 38)], [1e-5 / float(base(6)), 1.0],
                               rtol=1e-5)  # fmt: skip


def test_lr_rebound_never_goes_to_zero():
    # The reference's ramp k * (lr - 1e-5) / R is zero when the schedule sits at the floor.
    s = ABSchedule(warmup_steps=2, sync_every=4, full_rank_steps=1)
    lr = s.learning_rate(1e-5, rebound_steps=3, floor=1e-5)
    assert min(float(lr(t)) for t in range(12)) == pytest.approx(1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(warmup_steps=-1, sync_every=4, full_rank_steps=1), "warmup_steps"),
        (dict(warmup_steps=0, sync_every=1, full_rank_steps=1), "sync_every"),
        (dict(warmup_steps=0, sync_every=4, full_rank_steps=0), "full_rank_steps"),
        (dict(warmup_steps=0, sync_every=4, full_rank_steps=4), "full_rank_steps must be <"),
        (dict(warmup_steps=2.5, sync_every=4, full_rank_steps=1), "warmup_steps"),
    ],
)
def test_bad_schedules_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ABSchedule(**kwargs)
