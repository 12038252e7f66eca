"""Behaviour is asked of the object that owns it, never chosen by comparing names: no code outside the scheme,
output-format and input-decoder registries compares a scheme, format or ``quant_method`` name, no code outside
``moecompress/passes/`` compares a pass name (what the run needs of a pass is its registry entry's attribute or its
config's method), and no code outside ``moecompress/families/`` (and the synthetic checkpoint builders, which make
one checkpoint per family) names a family or compares an adapter's family."""

import re
from pathlib import Path

from moecompress.checkpoint.decoders import INPUT_DECODERS
from moecompress.families import ADAPTERS, REFUSED_FAMILIES
from moecompress.passes.registry import PASSES
from moecompress.quantization.formats import OUTPUT_FORMATS
from moecompress.quantization.schemes import SCHEME_KINDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moecompress"

REGISTRIES = (
    "quantization/scheme.py",
    "quantization/schemes/",
    "quantization/formats/",
    "checkpoint/decode.py",
    "checkpoint/decoders/",
)
KERNEL_NAMES = {
    # SchemeKind.cpu_matmul names a CPU kernel (the int4 one also reads int2 and w4a8 codes), not a scheme.
    ("quantization/cpu_forward.py", 'if _kind(module.scheme) == "mxfp4":'),
    ("quantization/cpu_forward.py", 'if kind == "mxfp4":'),
}


def _names_pattern(names: set[str]) -> str:
    return "|".join(sorted(map(re.escape, names), key=len, reverse=True))


def _dispatch_pattern(names: set[str]) -> re.Pattern:
    literal = rf"[\"']({_names_pattern(names)})[\"']"
    return re.compile(
        "|".join(
            (
                rf"[!=]=\s*{literal}",
                rf"{literal}\s*[!=]=",
                rf"\bin\s*[(\[{{][^)\]}}]*{literal}",
                r"\b(format|fmt|quant_method)\s*[!=]=\s*[\"']",
                r"quant_method[\"'][\])]\s*[!=]=",
                r"\b(format|quant_method)\s+(not\s+)?in\s*[(\[{]",
                r"scheme\.name\s*[!=]=",
            )
        )
    )


def _pass_pattern(names: set[str]) -> re.Pattern:
    """A comparison with a pass name (``== "qat"``, ``!= ["prune_experts"]``), a membership test in a literal
    collection of names, or a literal collection (not a call's arguments) of two or more of them."""
    literal = rf"[\"']({_names_pattern(names)})[\"']"
    return re.compile(
        "|".join(
            (
                rf"[!=]=\s*[(\[{{]?\s*{literal}",
                rf"{literal}\s*[)\]}}]?\s*[!=]=",
                rf"\bin\s*[(\[{{][^)\]}}]*{literal}",
                rf"([{{\[]|(?<![\w)\]])\()\s*{literal}\s*,\s*{literal}",
            )
        )
    )


def _family_pattern(names: set[str]) -> re.Pattern:
    return re.compile(rf"[\"']({_names_pattern(names)})[\"']|\bfamily\s*([!=]=|(not\s+)?in\b)")


def _hits(pattern: re.Pattern, skip) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if skip(relative):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and (relative, line.strip()) not in KERNEL_NAMES:
                found.append(f"moecompress/{relative}:{number}: {line.strip()}")
    return found


def _registered_names() -> set[str]:
    return set(SCHEME_KINDS) | set(OUTPUT_FORMATS) | set(INPUT_DECODERS)


def _family_names() -> set[str]:
    return {name for cls in ADAPTERS for name in (cls.family, *cls.model_types)} | set(REFUSED_FAMILIES)


def test_no_code_outside_the_registries_dispatches_on_a_scheme_format_or_decoder_name():
    pattern = _dispatch_pattern(_registered_names())
    assert _hits(pattern, lambda relative: relative.startswith(REGISTRIES) or relative.startswith("kernels/")) == []


def test_no_code_outside_passes_dispatches_on_a_pass_name():
    assert _hits(_pass_pattern(set(PASSES)), lambda relative: relative.startswith("passes/")) == []


def test_no_code_outside_families_names_a_family():
    pattern = _family_pattern(_family_names())
    assert _hits(pattern, lambda relative: relative.startswith(("families/", "synthetic"))) == []


def test_the_checks_find_what_they_look_for():
    dispatch = _dispatch_pattern(_registered_names())
    for line in (
        'if config.format == "native":',
        'if "gpt-oss" != fmt:',
        'if scheme in ("int4", "int2"):',
        'if quant_method == "fp8":',
        "if self.format in (NATIVE, GPT_OSS):",
        "if scheme.name == name:",
        'if quantization.get("quant_method") == "moecompress":',
    ):
        assert dispatch.search(line), line
    for line in ('"format": "bf16",', "layout = format_of(config.format)", 'if dtype == "bfloat16":'):
        assert not dispatch.search(line), line
    passes = _pass_pattern(set(PASSES))
    for line in (
        'if name == "qat":',
        'if "prune_heads" != name:',
        'if name in ("prune_experts", "quantize") and quantized:',
        'if [name for name, _ in recipe.passes] != ["prune_experts"]:',
        'QUANTIZING = frozenset({"quantize", "qat"})',
        'PRUNING = ("prune_experts", "prune_heads")',
        'settings = report.get("quantize_config") if name == "qat" else report.get("config")',
    ):
        assert passes.search(line), line
    for line in (
        'recipe, model_dir = _one_pass("prune", "prune_experts", model, options, calibration, evaluation)',
        'passes=[("quantize", config)],',
        '@config_options("qat")',
        'if name == "lowrank":',
        "if entry.quantizes and quantized_at:",
        'for step in progress_bar(range(config.steps), desc="qat", unit="step"):',
    ):
        assert not passes.search(line), line
    family = _family_pattern(_family_names())
    for line in ('if adapter.family == "gpt_oss":', "if adapter.family in PER_EXPERT:", 'SHARED = {"qwen3_moe": 1}'):
        assert family.search(line), line
    for line in ('if "model_type" in config:', 'raise ValueError(f"{adapter.family}: no")'):
        assert not family.search(line), line
