"""No import cycle among moecompress's modules at module level (scripts/import_cycles.py lists them), and the
layering that keeps the checkpoint layer below the passes: nothing in ``checkpoint/`` imports a pass, the sweep, the
runner or the CLI, not even inside a function (checkpoint/mtp -> passes/prune_experts closed the cycle issue 37
named)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
import_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_cycles)


def test_no_module_level_cycle():
    assert import_cycles.cycles(import_cycles.import_graph(ROOT / "moecompress")) == []


def test_the_lister_finds_a_planted_cycle_and_only_at_module_level(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("from ..a import x\n")
    (package / "c.py").write_text("def f():\n    from . import d\n")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import f\nimport pkg.c\n"
    )
    graph = import_cycles.import_graph(package)
    assert import_cycles.cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    assert import_cycles.cycles(import_cycles.import_graph(package, module_level=False)) == [
        ["pkg.a", "pkg.sub.b"],
        ["pkg.c", "pkg.d"],
    ]


def test_the_checkpoint_layer_imports_no_pass_sweep_runner_or_command():
    graph = import_cycles.import_graph(ROOT / "moecompress", module_level=False)
    above = ("moecompress.passes", "moecompress.sweep", "moecompress.runner", "moecompress.cli", "moecompress.api")
    reaching_up = {
        module: sorted(t for t in targets if t.startswith(above))
        for module, targets in graph.items()
        if module.startswith("moecompress.checkpoint")
    }
    assert {m: t for m, t in reaching_up.items() if t} == {}
