"""The component benchmarks run end to end on small inputs (they measure; nothing here times them)."""

import os
import time

import torch

from ragen_async.bench.components import (
    HOPS,
    SOKOBAN,
    GroupShape,
    TransportRow,
    bench_transport,
    bench_weights_one,
    format_transport,
    format_weights,
    synthetic_group,
)
from ragen_async.bench.pipeline import split_cpus
from ragen_async.weight_sync.wire import make_manifest, pack_bucket, plan_buckets


def test_synthetic_groups_are_valid_and_sized():
    group = synthetic_group(SOKOBAN, 3)
    assert len(group.trajectories) == 8 and group.index == 3
    for traj in group.trajectories:
        traj.validate()
        assert len(traj.token_ids) == SOKOBAN.tokens_per_trajectory
        assert int(traj.loss_mask.sum()) == SOKOBAN.turns * SOKOBAN.reply_tokens


def test_transport_bench_moves_every_group_on_both_paths():
    small = GroupShape("small", 2, prompt_tokens=10, turns=2, reply_tokens=3, feedback_tokens=4)
    rows = bench_transport({small: 20}, repeats=1)
    assert [(r.hop, r.path, r.groups) for r in rows] == [(hop, path, 20) for hop in HOPS for path in ("project", "raw")]
    assert all(r.seconds > 0 and r.mb_per_group > 0 and r.sender_cpu_s > 0 and r.receiver_cpu_s > 0
               and 0 < r.receiver_thread_cpu_s < r.receiver_cpu_s for r in rows)
    table = format_transport(rows)
    assert all(f"| small (20 per run) | {hop} |" in table for hop in HOPS)
    body = table.splitlines()[2:]
    assert len(body) == len(HOPS) and all(" ± " not in line and " (1) | " in line for line in body)  # one pair


def test_pinned_transport_bench_runs_the_ends_on_disjoint_cpus():
    small = GroupShape("small", 2, prompt_tokens=10, turns=2, reply_tokens=3, feedback_tokens=4)
    allowed = os.sched_getaffinity(0)
    unpinned = bench_transport({small: 10}, repeats=1, hops=("driver receive",))
    assert all(set(r.sender_cpus) == set(r.receiver_cpus) == allowed for r in unpinned)
    rows = bench_transport({small: 10}, repeats=1, hops=("driver receive",), pin=True)
    sender, receiver = map(set, split_cpus(sorted(allowed)))
    assert sender and receiver and not sender & receiver and sender | receiver == allowed
    assert [(set(r.sender_cpus), set(r.receiver_cpus)) for r in rows] == [(sender, receiver)] * 2  # project, raw
    assert all(r.groups == 10 and r.receiver_thread_cpu_s > 0 for r in rows)
    assert os.sched_getaffinity(0) == allowed  # restored


def test_transport_table_pairs_each_project_run_with_the_raw_run_after_it():
    def row(path: str, seconds: float) -> TransportRow:
        return TransportRow("s", "driver receive", path, groups=100, mb_per_group=1.0, seconds=seconds,
                            sender_cpu_s=seconds / 2, receiver_cpu_s=seconds, receiver_thread_cpu_s=seconds / 4)

    # project 100, 200, 300 MB/s; raw 200, 200, 400: ratios 0.5, 1.0, 0.75 (mean 0.75, sd 0.25)
    rows = [row("project", 1.0), row("raw", 0.5), row("project", 0.5), row("raw", 0.5), row("project", 1 / 3),
            row("raw", 0.25)]
    line = format_transport(rows).splitlines()[-1]
    half = 4.302653 * 0.25 / 3 ** 0.5  # t(0.975, 2) * sd / sqrt(n)
    assert line == (f"| s (100 per run) | driver receive | 1.000 | 200 | 200 | 200 | 1.00 | 200 ± 248 "
                    f"| 0.75 ± {half:.2f} (3) | 2,500 / 5,000 (1,250) | 2,500 / 5,000 (1,250) |")


def test_process_cpu_time_keeps_the_time_of_threads_that_ended(monkeypatch):
    """A delta charges the process for a thread that ran and ended within it (summing the live threads'
    scheduler counts, the earlier Linux path, lost that time and drifted from psutil's total)."""
    import threading

    import psutil

    from ragen_async.bench import cputime

    spent: list[float] = []

    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        spent.append(time.thread_time() - start)

    before = cputime.process_cpu_s(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()
    assert cputime.process_cpu_s(os.getpid()) - before >= spent[0] >= 0.2
    assert abs(cputime.process_cpu_s() - cputime.process_cpu_s(os.getpid())) < 0.05  # this process, two ways

    def psutil_s() -> float:
        times = psutil.Process(os.getpid()).cpu_times()
        return times.user + times.system

    monkeypatch.setattr(cputime.sys, "platform", "darwin")  # elsewhere: psutil's process total
    low, value, high = psutil_s(), cputime.process_cpu_s(os.getpid()), psutil_s()
    assert 0 < low <= value <= high


def test_weights_bench_syncs_both_ways():
    named = [("a", torch.randn(64, 32)), ("b", torch.randn(100).to(torch.bfloat16)), ("c", torch.randn(7))]
    row = bench_weights_one("small", named, repeats=2)
    assert len(row.project_s) == len(row.raw_s) == 2
    assert row.megabytes == (64 * 32 * 4 + 100 * 2 + 7 * 4) / 1e6
    assert "| small |" in format_weights([row])


def test_pack_bucket_sends_a_lone_tensor_without_copying_and_reuses_buffers():
    lone = torch.randn(1000)
    pair = [torch.randn(10), torch.randn(20)]
    tensors = [lone, *pair]
    manifest = make_manifest([("lone", lone), ("x", pair[0]), ("y", pair[1])])
    big, small = plan_buckets(manifest, bucket_bytes=1000)
    assert big.indices == (0,) and small.indices == (1, 2)
    view = pack_bucket(big, tensors)
    assert view.data_ptr() == lone.data_ptr() and view.dtype == torch.uint8
    first = pack_bucket(small, tensors)
    pair[0].add_(1.0)
    again = pack_bucket(small, tensors, out=first)
    assert again.data_ptr() == first.data_ptr()
    assert torch.equal(again.view(torch.float32)[:10], pair[0])
