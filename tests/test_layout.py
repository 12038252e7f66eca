"""docs/design.md describes the package as it is: its Layout table names every folder and top-level module of
``moecompress``, and every file path the document names exists (a module moved or renamed fails here until the
document follows). The synthetic-checkpoint fixtures live in tests/, outside the installed package."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moecompress"
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _layout_section() -> str:
    return DESIGN.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def _first_cells() -> list[str]:
    rows = [line for line in _layout_section().splitlines() if line.startswith("| `")]
    return [row.split(" | ", 1)[0] for row in rows]


def _named_in_layout() -> set[str]:
    """Paths of the table's first column, relative to the repository root (a bare name is the package's)."""
    named = set()
    for cell in _first_cells():
        for token in re.findall(r"`([^`]+)`", cell):
            named.add(token if token.startswith(("moecompress/", "tests/")) else "moecompress/" + token)
    return named


def test_the_layout_table_names_every_folder_and_top_level_module():
    entries = {
        f"moecompress/{p.name}/" if p.is_dir() else f"moecompress/{p.name}"
        for p in PACKAGE.iterdir()
        if (p.is_dir() and p.name != "__pycache__") or p.suffix == ".py"
    }
    named = _named_in_layout()
    top = {n if n.count("/") == 1 else "/".join(n.split("/")[:2]) + "/" for n in named}
    assert sorted(entries - top) == []


def test_every_path_the_layout_table_names_exists():
    assert sorted(n for n in _named_in_layout() if not (ROOT / n).exists()) == []


def test_every_file_path_the_design_names_exists():
    """Found from the repository root, or as the end of a path under the package, tests, scripts, docs or recipes
    (the document abbreviates ``moecompress/passes/base.py`` to ``passes/base.py`` and, in a row about passes,
    to ``base.py``)."""
    names = {m.split(":")[0] for m in re.findall(r"`([\w./]+\.(?:py|md|yaml)(?::[\w.]+)?)`", DESIGN)}
    names |= set(re.findall(r"`([\w./]+\.py):[\w.]+", DESIGN))
    files = {
        "/" + p.relative_to(ROOT).as_posix()
        for d in ("moecompress", "tests", "scripts", "docs", "recipes")
        for p in (ROOT / d).rglob("*")
    } | {"/" + p.name for p in ROOT.iterdir()}
    missing = [name for name in sorted(names) if not any(f.endswith("/" + name) for f in files)]
    assert missing == []


def test_fixtures_are_outside_the_installed_package():
    assert not list(PACKAGE.rglob("synthetic*.py"))
    importing = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(from|import) (synthetic|helpers|conftest)\b", p.read_text(), re.M)
    ]
    assert importing == []


def test_a_family_is_its_module_one_registry_line_and_one_tiny_config():
    """What design.md's "A family" lists, and nothing else, puts a family under the tests: every adapter class that
    names its own family is in ``ADAPTERS`` (or refused by name), and every registered model type has a tiny
    config, over which tests/test_families.py and the ``tiny_checkpoints`` fixture run."""
    import importlib
    import inspect
    import pkgutil

    from synthetic import TINY_CONFIGS

    import moecompress.families as families
    from moecompress.families.base import FamilyAdapter

    unregistered = []
    for info in pkgutil.iter_modules(families.__path__):
        module = importlib.import_module(f"moecompress.families.{info.name}")
        for name, cls in vars(module).items():
            if (
                inspect.isclass(cls)
                and issubclass(cls, FamilyAdapter)
                and cls.__module__ == module.__name__
                and vars(cls).get("family")
                and cls not in families.ADAPTERS
                and cls.family not in families.REFUSED_FAMILIES
            ):
                unregistered.append(f"{info.name}.{name}")
    assert unregistered == []
    registered = {model_type for cls in families.ADAPTERS for model_type in cls.model_types}
    assert sorted(registered - set(TINY_CONFIGS)) == []
