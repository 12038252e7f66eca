"""Bad input on every command: exit code 2, exactly one line on stderr, nothing written, the input unchanged, and
refused before any work (issue 32). The cases are those of scripts/bad_input_table.py, which writes
docs/bad_input.md from them; they run in this process (the entry point's main), a few also through the console
script."""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_cli

from moecompress.checkpoint import resolve_model

_SPEC = importlib.util.spec_from_file_location(
    "bad_input_table", Path(__file__).parent.parent / "scripts" / "bad_input_table.py"
)
table = importlib.util.module_from_spec(_SPEC)
sys.modules["bad_input_table"] = table
_SPEC.loader.exec_module(table)
CASES = {case.id: case for case in table.CASES}


def _tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        digest.update(str(path.relative_to(directory)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The shared input models and a root for the cases' own directories; the built-in model and the shared
    models must be byte-identical after every case."""
    root, shared = tmp_path_factory.mktemp("cases"), tmp_path_factory.mktemp("models")
    table.prepare_shared(shared)
    tiny = resolve_model("builtin:tiny-moe")
    before = (_tree_digest(tiny), _tree_digest(shared))
    yield root, shared
    assert (_tree_digest(tiny), _tree_digest(shared)) == before


def test_the_table_has_at_least_190_cases_over_every_command():
    """73 before issue 40; its checks (overwrite, input, locks; consistency on read; ignored options and recipes)
    brought 117 more."""
    assert len(CASES) >= 190 and len(CASES) == len(table.CASES)
    commands = {case.args[0] for case in table.CASES}
    assert {"inspect", "eval", "prune", "quantize", "qat", "prune-heads", "run", "report", "push"} <= commands


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case_id, workspace):
    outcome, problems = table.check(CASES[case_id], *workspace)
    assert not problems, problems
    assert outcome.stdout == ""


def test_an_impossible_count_is_refused_before_the_calibration_sweep(workspace, tmp_path):
    """Through the console script, in line mode (stderr is not a terminal, so the sweep's progress lines would
    show): the one error line and nothing else, so no sweep started, and no hidden work directory. The in-process
    cases above run in line mode too, so their one line says the same for every case."""
    case = CASES["prune-keep-above-experts"]
    result = run_cli(*case.argv(tmp_path, workspace[1]))
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and case.expect in result.stderr, result.stderr
    assert "scoring experts" not in result.stderr and "started" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def _immutable(directory: Path) -> bool:
    """Make ``directory`` unwritable for this user: chattr +i (which stops root too) or, for others, mode 0o555."""
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0:
        return True
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return True
    return False


def test_out_in_an_unwritable_directory_is_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if not _immutable(locked):
        pytest.skip("no way to make a directory unwritable for root here (no chattr)")
    try:
        result = run_cli("prune", "builtin:tiny-moe", "--out", str(locked / "o"), "--no-eval")
    finally:
        subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
        locked.chmod(0o755)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"moecompress: error: --out {locked / 'o'}: cannot write in {locked} ("), line
    assert list(locked.iterdir()) == []
