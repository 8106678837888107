"""`yb_engine`'s public names are imported on first use, and its torch-free modules
import without torch (the `yb` launcher imports them and stays a light process)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import yb_engine


def _type_checking_names() -> set[str]:
    """The names `yb_engine/__init__.py` imports for type checkers."""
    tree = ast.parse(Path(yb_engine.__file__).read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    return {
        alias.name
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_every_public_name_resolves_to_the_module_that_defines_it() -> None:
    exported = {name for names in yb_engine._EXPORTS.values() for name in names}
    assert exported == set(yb_engine.__all__) == _type_checking_names()
    for module, names in yb_engine._EXPORTS.items():
        for name in names:
            assert getattr(yb_engine, name) is getattr(importlib.import_module(module), name)


def test_torch_free_modules_import_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        import yb_engine.kv_sizing, yb_engine.models, yb_engine.prepare
        assert "torch" not in sys.modules, "importing them imported torch"
        from yb_engine import PagedKVCache  # the first use of a public name imports it
        assert "torch" in sys.modules
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
