"""The architecture as a test: packages by dependency weight.

    core  <  dataplane, text  <  engine  <  the five services  <  tools (yb)  <  testkit

Each package imports only packages below it, and of the services only what it runs on:
the conductor runs on the contracts alone, the gateway adds text (tokenizer), the kvstore
adds the data plane, prefill and decode add the engine. No service imports another. Every
import counts, including those inside functions and under `TYPE_CHECKING`: a lazy import
is still a dependency of the package that makes it.

The layout is the design card's: the five services under `services/`, the libraries
they share under `shared/` (each its own versioned distribution), and no source file
reaches for the `../shared` folder that lies beside a checkout (development notes, never
read at run time).

Also checked: each package's pyproject declares the yuebing-* packages it imports and
nothing above it; the light packages import no heavy third-party library; the installed
dependency closure of the gateway and the conductor holds no torch, UCX, accelerate or
matplotlib; and the gateway and the conductor import and start (`--help`) in a process
where importing torch or ucxx raises.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = sorted(
    src for group in ("shared", "services", "tools") for src in (ROOT / group).glob("*/src")
)

CORE, DATAPLANE, TEXT, ENGINE = "yb_core", "yb_dataplane", "yb_text", "yb_engine"
SERVICES = ("yb_conductor", "yb_prefill", "yb_decode", "yb_kvstore", "yb_gateway")
TOOLS, TESTKIT = "yb_tools", "yb_testkit"
LIBRARIES = (CORE, DATAPLANE, TEXT, ENGINE)

#: Package -> the first-party packages it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    CORE: frozenset(),
    DATAPLANE: frozenset({CORE}),
    TEXT: frozenset({CORE}),
    ENGINE: frozenset({CORE, DATAPLANE, TEXT}),
    "yb_conductor": frozenset({CORE}),
    "yb_gateway": frozenset({CORE, TEXT}),
    "yb_kvstore": frozenset({CORE, DATAPLANE}),
    "yb_prefill": frozenset({CORE, DATAPLANE, TEXT, ENGINE}),
    "yb_decode": frozenset({CORE, DATAPLANE, TEXT, ENGINE}),
    TOOLS: frozenset({*LIBRARIES, *SERVICES}),
    TESTKIT: frozenset({*LIBRARIES, *SERVICES, TOOLS}),
}

#: Third-party libraries too heavy for the light packages: (module, who may import it).
HEAVY_MODULES: dict[str, frozenset[str]] = {
    "torch": frozenset(),
    "ucxx": frozenset(),
    "accelerate": frozenset(),
    "safetensors": frozenset(),
    "gguf": frozenset(),
    "matplotlib": frozenset(),
    "transformers": frozenset({TEXT, "yb_gateway"}),
    "tokenizers": frozenset({TEXT, "yb_gateway"}),
}
LIGHT_PACKAGES = (CORE, TEXT, "yb_conductor", "yb_gateway")

#: Distributions no gateway or conductor install may pull in (names or name prefixes).
HEAVY_DISTRIBUTIONS = ("torch", "ucxx", "accelerate", "matplotlib")


@dataclass(frozen=True)
class Import:
    """One import in a first-party module: what it names and where."""

    path: Path
    line: int
    module: str

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}: imports {self.module}"


def _package_dirs() -> dict[str, Path]:
    """Import name -> its package directory under some `src/`."""
    out: dict[str, Path] = {}
    for src in SOURCE_ROOTS:
        for package in src.iterdir():
            if (package / "__init__.py").is_file():
                assert package.name not in out, f"{package.name} is defined twice"
                out[package.name] = package
    return out


PACKAGES = _package_dirs()


def imports_of(path: Path) -> list[Import]:
    """Every absolute import in one module, at any depth (functions, `TYPE_CHECKING`,
    `try`), and every `importlib.import_module("...")` with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Import(path, node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(path, node.lineno, node.args[0].value))
    return sorted(found, key=lambda i: i.line)


def package_imports(package: str) -> list[Import]:
    """Every import made by the modules of one first-party package."""
    return [i for module in sorted(PACKAGES[package].rglob("*.py")) for i in imports_of(module)]


def layering_violations(package: str, imports: list[Import]) -> list[str]:
    """The imports of `package` that name a first-party package it may not use."""
    allowed = ALLOWED[package] | {package}
    return [
        f"{i.where()} ({package} may use {sorted(allowed - {package}) or 'no other package'})"
        for i in imports
        if i.top in ALLOWED and i.top not in allowed
    ]


def heavy_imports(package: str, imports: list[Import]) -> list[str]:
    """The imports of `package` that pull in a heavy third-party library it may not use."""
    return [
        f"{i.where()} ({i.top} is not for {package})"
        for i in imports
        if i.top in HEAVY_MODULES and package not in HEAVY_MODULES[i.top]
    ]


# --- the layout ---------------------------------------------------------------------

#: The top-level entries the design card names.
DESIGN_LAYOUT = (
    "services/conductor",
    "services/prefill",
    "services/decode",
    "services/kvstore",
    "services/gateway",
    "shared",
    "docker-compose.yml",
    "tests",
    "README.md",
)
#: The shared libraries, one distribution each: folder -> import name.
SHARED_LIBRARIES = {"core": CORE, "dataplane": DATAPLANE, "text": TEXT, "engine": ENGINE}


def test_the_layout_is_the_design_cards() -> None:
    missing = [entry for entry in DESIGN_LAYOUT if not (ROOT / entry).exists()]
    assert not missing, f"the design card's layout lacks {missing}"
    assert not (ROOT / "libs").exists(), "the shared libraries live under shared/, not libs/"
    assert sorted(p.name for p in (ROOT / "shared").iterdir() if p.is_dir()) == sorted(
        SHARED_LIBRARIES
    )
    for folder, package in SHARED_LIBRARIES.items():
        assert PACKAGES[package] == ROOT / "shared" / folder / "src" / package
        project = _pyproject(package)
        assert str(project["name"]).startswith("yuebing-") and project.get("version"), folder


#: A path that leaves the checkout for the `shared` folder beside it: "../shared",
#: or a walk above the repository root (`ROOT.parent / "shared"`, `parents[N]`).
BESIDE_CHECKOUT = re.compile(r"\.\./shared|\.parent\s*/\s*[\"']shared[\"']")


def beside_checkout_reads(text: str) -> list[int]:
    """Lines of `text` that name the folder beside the checkout."""
    return [n for n, line in enumerate(text.splitlines(), 1) if BESIDE_CHECKOUT.search(line)]


def test_nothing_reads_the_folder_beside_the_checkout() -> None:
    assert beside_checkout_reads('TRACE = ROOT.parent / "shared" / "traces"') == [1]
    assert beside_checkout_reads("open('../shared/traces/x.jsonl')") == [1]
    assert beside_checkout_reads('ROOT / "shared" / "core"') == []
    sources = [
        path
        for top in ("shared", "services", "tools", "benchmarks", "deploy")
        for path in (ROOT / top).rglob("*")
        if path.suffix in (".py", ".sh", ".toml", ".yml", ".yaml", ".conf")
        and "__pycache__" not in path.parts
    ]
    sources += [ROOT / name for name in ("Dockerfile", "setup.sh", "run-tests.sh")]
    sources += list(ROOT.glob("docker-compose*.yml"))
    assert len(sources) > 100
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sources
        for line in beside_checkout_reads(path.read_text(errors="replace"))
    ]
    assert not found, f"these name the ../shared folder beside the checkout: {found}"


# --- imports ----------------------------------------------------------------------


def test_every_package_is_known() -> None:
    assert set(PACKAGES) == set(ALLOWED), "a package under */src is missing from ALLOWED"
    # The rules themselves form layers: nothing allowed both ways.
    for package, allowed in ALLOWED.items():
        for other in allowed:
            assert package not in ALLOWED[other], (package, other)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_packages_below_them(package: str) -> None:
    violations = layering_violations(package, package_imports(package))
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("package", LIGHT_PACKAGES)
def test_light_packages_import_no_heavy_library(package: str) -> None:
    violations = heavy_imports(package, package_imports(package))
    assert not violations, "\n".join(violations)


def test_the_checks_catch_a_bad_import(tmp_path: Path) -> None:
    # A lazy import inside a function, a TYPE_CHECKING import and import_module all count.
    module = tmp_path / "bad.py"
    module.write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from yb_engine.loader import LoadedModel
            def f():
                import torch.nn
                from yb_prefill import service
                return importlib.import_module("yb_tools.cli")
            """
        )
    )
    found = imports_of(module)
    assert [(i.line, i.module) for i in found if i.module != "typing"] == [
        (4, "yb_engine.loader"),
        (6, "torch.nn"),
        (7, "yb_prefill"),
        (8, "yb_tools.cli"),
    ]
    gateway = layering_violations("yb_gateway", found)
    assert [v.split(": imports ")[1].split(" ")[0] for v in gateway] == [
        "yb_engine.loader",
        "yb_prefill",
        "yb_tools.cli",
    ]
    assert gateway[0].startswith(f"{module}:4: imports yb_engine.loader")
    assert layering_violations(TOOLS, found) == []
    assert heavy_imports("yb_conductor", found) == [
        f"{module}:6: imports torch.nn (torch is not for yb_conductor)"
    ]


# --- pyproject.toml -----------------------------------------------------------------


def _pyproject(package: str) -> dict[str, object]:
    source = PACKAGES[package].parents[1]
    return dict(tomllib.loads((source / "pyproject.toml").read_text())["project"])


def distribution_of(package: str) -> str:
    return str(canonicalize_name(str(_pyproject(package)["name"])))


def _declared(package: str) -> set[str]:
    dependencies = _pyproject(package).get("dependencies") or []
    assert isinstance(dependencies, list)
    return {str(canonicalize_name(Requirement(d).name)) for d in dependencies}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_pyproject_declares_what_the_package_imports_and_nothing_above(package: str) -> None:
    first_party = {distribution_of(p): p for p in ALLOWED}
    declared = {d for d in _declared(package) if d in first_party}
    imported = {i.top for i in package_imports(package) if i.top in ALLOWED} - {package}
    missing = sorted(distribution_of(p) for p in imported if distribution_of(p) not in declared)
    assert not missing, f"{package} imports {missing} without declaring them"
    above = sorted(d for d in declared if first_party[d] not in ALLOWED[package])
    assert not above, f"{package} depends on {above}, which it may not use"


# --- the installed closure -----------------------------------------------------------


def installed_closure(distribution: str) -> dict[str, str]:
    """Every distribution an install of `distribution` brings, following Requires-Dist
    (with the requested extras and this interpreter's markers) through the installed
    distributions: name -> the chain that pulls it in. A requirement that is not installed
    here is listed but not followed."""
    chains = {str(canonicalize_name(distribution)): distribution}
    pending: list[tuple[str, frozenset[str]]] = [(distribution, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, extras = pending.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not any(
                requirement.marker.evaluate({"extra": extra}) for extra in (extras or {""})
            ):
                continue
            dependency = str(canonicalize_name(requirement.name))
            chains.setdefault(dependency, f"{chains[str(canonicalize_name(name))]} -> {dependency}")
            pending.append((dependency, frozenset(requirement.extras)))
    return chains


@pytest.mark.parametrize("package", ["yb_gateway", "yb_conductor"])
def test_installing_the_gateway_or_conductor_brings_no_torch_or_ucx(package: str) -> None:
    closure = installed_closure(distribution_of(package))
    assert "yuebing-core" in closure  # the walk follows the declared dependencies
    heavy = [chain for name, chain in closure.items() if name.startswith(HEAVY_DISTRIBUTIONS)]
    assert not heavy, "\n".join(heavy)


def test_the_closure_finds_torch_where_it_is() -> None:
    # The same walk sees the heavy libraries of a package that has them.
    closure = installed_closure("yuebing-tools")
    assert "matplotlib" in closure and "accelerate" in closure
    assert any(name.startswith("ucxx") for name in closure)


# --- importing without torch or ucxx ---------------------------------------------------

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, runpy, sys

    BLOCKED = ("torch", "ucxx")

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"blocked: {name}", name=name)
            return None

    sys.meta_path.insert(0, Blocked())
    """
)


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter in which importing torch or ucxx raises."""
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_blocker_blocks() -> None:
    run = run_blocked("import yb_engine.runner")
    assert run.returncode != 0
    assert "blocked: torch" in run.stderr


@pytest.mark.parametrize("module", ["yb_gateway.service", "yb_gateway.app", "yb_conductor.service"])
def test_gateway_and_conductor_import_without_torch_or_ucx(module: str) -> None:
    run = run_blocked(
        f"""
        import importlib
        importlib.import_module({module!r})
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        """
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("package", ["yb_gateway", "yb_conductor"])
def test_gateway_and_conductor_start_without_torch_or_ucx(package: str) -> None:
    run = run_blocked(
        f"""
        sys.argv = [{package!r}, "--help"]
        runpy.run_module({package!r}, run_name="__main__", alter_sys=True)
        """
    )
    assert run.returncode == 0, run.stderr
    assert "--instance-id" in run.stdout


# --- the compose actuator's image ------------------------------------------------------

#: What the planner-actuator image (the Dockerfile's `planner-actuator` stage) lacks:
#: every first-party package but core and the yb tool, and the heavy libraries.
NOT_IN_ACTUATOR_IMAGE = (
    *sorted(set(ALLOWED) - {CORE, TOOLS}),
    *sorted(HEAVY_MODULES),
)


def test_the_compose_actuator_starts_with_core_and_the_yb_tool_alone() -> None:
    blocked = BLOCKER.replace('("torch", "ucxx")', repr(NOT_IN_ACTUATOR_IMAGE))
    assert blocked != BLOCKER
    code = textwrap.dedent(
        """
        sys.argv = ["yb_tools.compose_actuator", "--help"]
        try:
            runpy.run_module("yb_tools.compose_actuator", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        assert "yb_tools.compose_actuator.actuator" in sys.modules
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert "--max-instances" in run.stdout
