"""scripts/family_sweep.py: the MoE model types it finds in transformers' registries and the status moecompress
gives each."""

import importlib.util
import sys
from pathlib import Path

import pytest

from moecompress.families import ADAPTERS, REFUSED_FAMILIES

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("family_sweep", ROOT / "scripts" / "family_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["family_sweep"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    entries, module_only = module.enumerate_moe_types()
    for entry in entries:
        module.status_of(entry)
    return module, {entry.model_type: entry for entry in entries}, dict(module_only)


def test_known_types_have_their_status(sweep):
    _, entries, _ = sweep
    qwen = entries["qwen3_moe"]
    assert (qwen.status, qwen.evidence, qwen.kind) == ("supported", "num_experts", "causal LM")
    assert qwen.reason.startswith("qwen3_moe: 2/2 MoE layers, 8 experts")
    assert entries["kimi_k25"].evidence == "text_config.n_routed_experts" and entries["kimi_k25"].status == "supported"
    assert entries["kimi_k2"].status == "supported"
    dbrx = entries["dbrx"]
    assert (dbrx.status, dbrx.evidence) == ("supported", "ffn_config.moe_num_experts")
    assert dbrx.reason.startswith("dbrx: 2/2 MoE layers, 8 experts, top-2")
    nllb = entries["nllb-moe"]
    assert (nllb.status, nllb.reason) == ("refused", f"nllb-moe is not supported: {REFUSED_FAMILIES['nllb-moe']}")
    assert entries["jamba"].status == "supported"
    assert entries["step3p5"].reason.startswith("step3p5 is not supported: step3p5 is a sub-config of step3p7")
    assert not [name for name, entry in entries.items() if entry.status == "error"]


def test_every_type_moecompress_names_is_enumerated(sweep):
    _, entries, _ = sweep
    supported = {model_type for cls in ADAPTERS for model_type in cls.model_types}
    assert supported <= set(entries)
    assert {name for name, entry in entries.items() if entry.status == "supported"} == supported
    refused_here = {name for name in REFUSED_FAMILIES if name in entries}
    assert all(
        entries[name].status == "refused" and "is not supported" in entries[name].reason for name in refused_here
    )


def test_dense_and_vision_configs_are_not_counted(sweep):
    _, entries, module_only = sweep
    assert "llama" not in entries and "qwen3" not in entries
    assert "qwen3_vl_moe_vision" in module_only and "qwen3_vl_moe_vision" not in entries
    assert entries["gemma4_text"].status == "supported"  # counted although its default config is dense
    assert entries["mistral3"].evidence == "text_config.n_routed_experts"  # dense default, MoE release


def test_markdown_section_replaces_only_its_own_lines(sweep, tmp_path):
    module, entries, module_only = sweep
    doc = tmp_path / "families.md"
    doc.write_text(f"# head\n\n{module.BEGIN}\nold\n{module.END}\n\n## tail\n")
    section = module.markdown([entries["qwen3_moe"], entries["nllb-moe"]], list(module_only.items()), "cmd")
    module.update_doc(doc, section)
    text = doc.read_text()
    assert text.startswith("# head\n\n") and text.endswith("\n\n## tail\n") and "old" not in text
    assert "| `qwen3_moe` | causal LM | `num_experts` | `Qwen3MoeExperts` | supported (qwen3_moe:" in text
    assert "2 MoE types" in text and "1 supported, 1 refused" in text
