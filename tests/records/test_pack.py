"""``ragen-async pack``: a run's records compressed to commit a study's runs, read back by report, audit and watch."""

import gzip
import json

from typer.testing import CliRunner

from ragen_async.cli import app
from ragen_async.records.provenance import read_provenance
from ragen_async.records.rundir import pack_run, read_record, record_file, unpack_run
from ragen_async.study.report import find_runs


def test_packing_is_exact_deterministic_and_undone_by_unpacking(tmp_path, make_run):
    run = make_run(tmp_path / "k1-s0", steps=20, k=1)
    (run / "provenance.jsonl").write_text(json.dumps({"step": 1, "groups": [], "dropped": []}) + "\n")
    plain = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "provenance.jsonl")}
    packed = pack_run(run)
    assert sorted(p.name for p in packed) == ["metrics.jsonl.gz", "provenance.jsonl.gz"]
    assert not (run / "metrics.jsonl").exists() and record_file(run / "metrics.jsonl") == packed[0]
    assert all(gzip.decompress((run / f"{n}.gz").read_bytes()) == data for n, data in plain.items())
    assert read_record(run / "metrics.jsonl") == plain["metrics.jsonl"].decode()
    assert read_provenance(run / "provenance.jsonl") == [{"step": 1, "groups": [], "dropped": []}]
    first = (run / "metrics.jsonl.gz").read_bytes()
    unpack_run(run)
    assert {n: (run / n).read_bytes() for n in plain} == plain and not list(run.glob("*.gz"))
    pack_run(run)
    assert (run / "metrics.jsonl.gz").read_bytes() == first  # same bytes: no name or time in the header


def test_report_watch_and_pack_read_a_packed_run_and_pack_skips_one_still_going(tmp_path, make_run):
    done = make_run(tmp_path / "runs" / "k1-s0", steps=20, k=1)
    going = make_run(tmp_path / "runs" / "k1-s1", steps=20, k=1, logged_steps=8)
    before = {r.name: (r.train, r.val) for r in find_runs([tmp_path / "runs"])[0]}
    result = CliRunner().invoke(app, ["pack", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert "packed 1 runs, skipped 1" in result.output and "at step 8 of 20" in result.output
    assert (done / "metrics.jsonl.gz").is_file() and (going / "metrics.jsonl").is_file()
    after = {r.name: (r.train, r.val) for r in find_runs([tmp_path / "runs"])[0]}
    assert after == before  # every record read back as it was
    watch = CliRunner().invoke(app, ["watch", str(done), "--once"])
    assert watch.exit_code == 0 and "k1-s0: step 20 of 20" in watch.output
    report = CliRunner().invoke(app, ["report", str(tmp_path / "runs"), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0 and "2 runs" in report.output
    result = CliRunner().invoke(app, ["pack", str(going), "--unfinished"])
    assert "packed 1 runs, skipped 0" in result.output and (going / "metrics.jsonl.gz").is_file()
