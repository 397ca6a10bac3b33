"""The suite's own machinery: `make test` runs `pytest -n 2 --dist loadgroup`, and the modules that build engines
once (or start one Triton server) rely on `xdist_group` sending all their tests to one worker. With pytest 9,
pytest-xdist 3.8 silently stopped grouping (both workers built the pipeline engines, about 5 minutes each), so
this pins the behaviour with the installed pair."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_group_runs_on_one_worker_and_sets_its_fixture_up_once(tmp_path):
    log = tmp_path / "log"
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent(f"""
        import os
        import pytest

        pytestmark = pytest.mark.xdist_group("engines")

        @pytest.fixture(scope="session")
        def engine():
            open({str(log)!r}, "a").write("setup\\n")

        @pytest.mark.parametrize("case", range(6))
        def test_uses_the_engine(engine, case):
            open({str(log)!r}, "a").write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        """))
    (tmp_path / "test_other.py").write_text("def test_a(): pass\ndef test_b(): pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = log.read_text().split()
    assert lines.count("setup") == 1 and len(set(lines) - {"setup"}) == 1
