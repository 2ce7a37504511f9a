"""The rules live in ``protocol/`` only. Every shell reads frames through
``protocol.framing.FrameScanner`` (``frames_in`` for a log read back), so the tests that split
streams at every byte cover the code that runs; and no shell compares incarnations itself (which
one replaces which is the cores' rule: ``relay_core``, ``rank_link``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELLS = ("relay", "worker_agent", "sdk", "mpi", "coordinator", "web", "vpool")


def _parsing(tree: ast.AST) -> list[tuple[int, str]]:
    """What in a module reads frame prefixes by itself."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name == "parse_prefix":
                found.append((node.lineno, "parse_prefix"))
            if name in ("unpack", "unpack_from") and isinstance(func, ast.Attribute):
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id == "PREFIX":
                    found.append((node.lineno, f"PREFIX.{name}"))
            if name == "Struct" and node.args and isinstance(node.args[0], ast.Constant):
                if node.args[0].value == "!II":
                    found.append((node.lineno, 'Struct("!II")'))
        elif isinstance(node, ast.ClassDef) and (
            "FrameReader" in node.name or "Decoder" in node.name
        ):
            found.append((node.lineno, f"class {node.name}"))
    return sorted(found)


def test_no_shell_parses_frames_itself() -> None:
    offenders = []
    for folder in SHELLS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, what in _parsing(ast.parse(path.read_text())):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert offenders == [], "read frames with protocol.framing.FrameScanner:\n" + "\n".join(
        offenders
    )


def test_the_guard_finds_each_way() -> None:
    src = (
        "import struct\n"
        "h, p = PREFIX.unpack_from(buf, 0)\n"
        "h, p = parse_prefix(buf[:8])\n"
        "_u = struct.Struct('!II').unpack_from\n"
        "class FrameReader: pass\n"
    )
    assert [what for _, what in _parsing(ast.parse(src))] == [
        "PREFIX.unpack_from",
        "parse_prefix",
        'Struct("!II")',
        "class FrameReader",
    ]


def _incarnations(tree: ast.AST) -> list[tuple[int, str]]:
    """Comparisons of incarnations, and the newest of several taken by hand."""

    def named(x: ast.expr) -> bool:
        if isinstance(x, ast.Attribute):
            return x.attr == "incarnation"
        return isinstance(x, ast.Name) and x.id in ("incarnation", "inc")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(x) for x in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("max", "min")
            and "incarnation" in ast.unparse(node)
        ):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_shell_compares_incarnations() -> None:
    offenders = []
    for folder in ("relay", "worker_agent", "sdk", "mpi", "vpool"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, what in _incarnations(ast.parse(path.read_text())):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert offenders == [], "incarnation rules belong to the protocol cores:\n" + "\n".join(
        offenders
    )


def test_the_incarnation_guard_finds_each_way() -> None:
    src = (
        "if lease.incarnation > 1: pass\n"
        "ok = inc < top\n"
        "top = max(i.incarnation for i in imgs)\n"
        "fine = lease.job == job\n"
    )
    assert [line for line, _ in _incarnations(ast.parse(src))] == [1, 2, 3]
