"""The bytes a fixed list of commands writes on builtin:tiny-moe (prune by layer and globally, quantize by RTN with its
default evaluation, GPTQ, low-rank adapters, binary, compressed-tensors, qat, prune-heads, the default recipe shrunk
through its own keys, and that recipe killed after two layers and resumed) equal the hashes recorded in
tests/golden_outputs.json, with one CPU thread. How they are run, hashed and normalised, and how to re-record:
scripts/record_golden_outputs.py.

Bytes differ with the CPU's vector units and the versions of torch and numba, so where the platform's fingerprint is
not the recorded one the comparison is skipped, saying what differs."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_golden_outputs", ROOT / "scripts" / "record_golden_outputs.py")
recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recorder)

GOLDEN = json.loads(recorder.GOLDEN.read_text())


@pytest.fixture(scope="module")
def same_platform():
    recorded, current = GOLDEN["fingerprint"], recorder.platform_fingerprint()
    differing = [f"{k} recorded {recorded.get(k)}, here {now}" for k, now in current.items() if recorded.get(k) != now]
    if differing:
        pytest.skip(
            "the golden bytes were recorded on another platform, where float rounding differs: "
            + "; ".join(differing)
            + " (scripts/record_golden_outputs.py re-records)"
        )


def test_every_case_has_recorded_hashes():
    recorded = {recorder.RECORDED_AS.get(name, name) for name in recorder.CASES}
    assert set(GOLDEN["outputs"]) == recorded


@pytest.mark.parametrize("case", recorder.CASES)
def test_the_output_has_the_recorded_bytes(case, same_platform):
    expected = GOLDEN["outputs"][recorder.RECORDED_AS.get(case, case)]
    hashes = recorder.run_case(case)
    differing = sorted(name for name in expected.keys() | hashes.keys() if expected.get(name) != hashes.get(name))
    assert not differing, f"{case}: these files' bytes changed: {differing}"
