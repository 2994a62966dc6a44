"""When the byte-exact weight check and the log-prob probe run (``verify.checks_due``): the check at the first
sync by default, and at every ``verify_every``-th; the probe only at every ``verify_every``-th."""

from ragen_async.config import load_config
from ragen_async.weight_sync.verify import checks_due


def _schedule(n: int, **ws) -> tuple[list[int], list[int]]:
    due = [checks_due(s, **ws) for s in range(1, n + 1)]
    return [s for s, (c, _) in enumerate(due, 1) if c], [s for s, (_, p) in enumerate(due, 1) if p]


def test_the_default_config_checks_the_first_sync_only():
    ws = load_config(None).weight_sync
    assert (ws.verify_first, ws.verify_every) == (True, 0)
    assert _schedule(30, verify_first=ws.verify_first, verify_every=ws.verify_every, probe=ws.probe) == ([1], [])


def test_every_n_checks_the_first_and_every_nth_and_probes_every_nth():
    assert _schedule(25, verify_first=True, verify_every=10, probe=True) == ([1, 10, 20], [10, 20])
    # verify_every alone still checks the first sync (as before verify_first existed)
    assert _schedule(25, verify_first=False, verify_every=10, probe=False) == ([1, 10, 20], [])
    assert _schedule(3, verify_first=False, verify_every=1, probe=True) == ([1, 2, 3], [1, 2, 3])


def test_both_off_checks_nothing():
    assert _schedule(30, verify_first=False, verify_every=0, probe=True) == ([], [])
