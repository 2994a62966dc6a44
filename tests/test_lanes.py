"""`make test`'s lanes (tests/conftest.py): chosen by each module's marker, and a test in no lane that leaves a Ray
session running is refused."""

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def test_a_module_s_lane_is_the_marker_it_sets(tmp_path):
    from tests.conftest import _module_lane

    (tmp_path / "test_a.py").write_text("import pytest\n\npytestmark = pytest.mark.ray_lane\n")
    (tmp_path / "test_b.py").write_text("import pytest\n\npytestmark = [pytest.mark.clusters_lane, pytest.mark.slow]\n")
    (tmp_path / "test_c.py").write_text("def test_x():\n    pass\n")
    assert [_module_lane(tmp_path / f"test_{m}.py") for m in "abc"] == ["ray_lane", "clusters_lane", None]


def test_a_test_in_no_lane_that_leaves_ray_running_fails(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    ray_lane: x\n    clusters_lane: x\n    alone: x\n    vllm: x\n")
    fake_ray = ("import sys, types\n"
                "sys.modules['ray'] = types.SimpleNamespace(is_initialized=lambda: True, shutdown=lambda: None)\n")
    pytester.makepyfile(test_stray="def test_starts_ray():\n    " + fake_ray.replace("\n", "\n    ") + "\n",
                        test_laned="import pytest\npytestmark = pytest.mark.ray_lane\n\n"
                                   "def test_starts_ray():\n    " + fake_ray.replace("\n", "\n    ") + "\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_stray.py::test_starts_ray started a Ray session but its module is in no lane*"])


def test_the_alone_part_imports_only_the_modules_that_name_the_alone_marker(pytester):
    from tests.conftest import ALONE_PART

    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    alone: x\n    soak: x\n")
    pytester.makepyfile(test_quiet="import pytest\npytestmark = pytest.mark.alone\n\ndef test_a():\n    pass\n",
                        test_other="raise RuntimeError('imported')\n\ndef test_b():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-m", ALONE_PART)
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-m", "not alone")
    result.assert_outcomes(errors=1)  # any other selection imports every module
