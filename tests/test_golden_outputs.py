"""The bytes a fixed list of commands writes on builtin:tiny-moe (prune by layer and globally, quantize by RTN with its
default evaluation, GPTQ, low-rank adapters, binary, compressed-tensors, qat, prune-heads, the default recipe shrunk
through its own keys, and that recipe killed after two layers and resumed) equal the hashes recorded in
tests/golden_outputs.json, with one CPU thread. How they are run, hashed and normalised, and how to re-record:
scripts/record_golden_outputs.py.

Bytes differ with the CPU's vector units and the versions of torch and numba, so the file holds one record a
platform, all made at the same code, and the comparison uses the record whose fingerprint is this platform's; where
none is, it is skipped, saying what differs."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_golden_outputs", ROOT / "scripts" / "record_golden_outputs.py")
recorder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recorder)

PLATFORMS = recorder.recorded_platforms()


@pytest.fixture(scope="module")
def this_platform() -> dict:
    """The record made on this platform (skips where there is none)."""
    current = recorder.platform_fingerprint()
    for platform in PLATFORMS:
        if platform["fingerprint"] == current:
            return platform
    differing = [
        ", ".join(f"{k} recorded {p['fingerprint'].get(k)}, here {now}" for k, now in current.items()
                  if p["fingerprint"].get(k) != now)
        for p in PLATFORMS
    ]  # fmt: skip
    pytest.skip(
        "the golden bytes were recorded on other platforms, where float rounding differs: "
        + "; ".join(f"record {i + 1}: {d}" for i, d in enumerate(differing))
        + " (scripts/record_golden_outputs.py adds this one)"
    )


def test_every_record_has_every_case_and_its_own_platform():
    cases = {recorder.RECORDED_AS.get(name, name) for name in recorder.CASES}
    assert PLATFORMS
    assert all(set(platform["outputs"]) == cases for platform in PLATFORMS)
    fingerprints = [json.dumps(platform["fingerprint"], sort_keys=True) for platform in PLATFORMS]
    assert len(set(fingerprints)) == len(fingerprints)


@pytest.mark.parametrize("case", recorder.CASES)
def test_the_output_has_the_recorded_bytes(case, this_platform):
    expected = this_platform["outputs"][recorder.RECORDED_AS.get(case, case)]
    hashes = recorder.run_case(case)
    differing = sorted(name for name in expected.keys() | hashes.keys() if expected.get(name) != hashes.get(name))
    assert not differing, f"{case}: these files' bytes changed: {differing}"
