"""The wall-clock training budget: charges only running spans, stops once the limit is reached."""

from ragen_async.records.budget import TrainingBudget


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_no_limit_is_never_exhausted():
    clock = FakeClock()
    budget = TrainingBudget(None, clock)
    budget.start()
    clock.now += 1e9
    assert not budget.exhausted
    assert budget.spent_s == 1e9


def test_paused_time_is_not_charged():
    clock = FakeClock()
    budget = TrainingBudget(1.0, clock)  # 60 s
    budget.start()
    clock.now += 40
    budget.pause()
    clock.now += 1000  # validation: free
    assert budget.spent_s == 40 and not budget.exhausted
    budget.start()
    clock.now += 19.5
    assert not budget.exhausted
    clock.now += 0.5
    assert budget.exhausted
    budget.pause()
    budget.pause()  # idempotent
    assert budget.spent_s == 60


def test_start_twice_does_not_reset_the_span():
    clock = FakeClock()
    budget = TrainingBudget(1.0, clock)
    budget.start()
    clock.now += 30
    budget.start()
    clock.now += 30
    assert budget.spent_s == 60 and budget.exhausted


def test_the_run_ends_at_the_step_count_or_the_spent_budget_and_says_which():
    clock = FakeClock()
    budget = TrainingBudget(1.0, clock)
    budget.start()
    assert budget.end_reason(3, 10) is None
    assert budget.end_reason(10, 10) == "stopped after step 10: total_steps=10 reached"
    clock.now += 60
    assert budget.end_reason(3, 10) == ("stopped after step 3 of total_steps=10: time_budget_minutes=1 spent "
                                        "(1.0 min of training)")
    assert TrainingBudget(None, clock).end_reason(3, 10) is None


def test_a_resumed_budget_continues_from_what_was_spent():
    clock = FakeClock()
    budget = TrainingBudget(1.0, clock)
    budget.start()
    clock.now += 45
    budget.pause()
    resumed = TrainingBudget(1.0, clock)
    resumed.restore(budget.state())
    assert resumed.spent_s == 45 and not resumed.exhausted
    resumed.start()
    clock.now += 15
    assert resumed.exhausted  # 45 + 15 = the 60 s limit: a requeued run does not get its minutes again
