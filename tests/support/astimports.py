"""The imports a module's AST makes, read without importing it (the layering and
planning-purity tests)."""

from __future__ import annotations

import ast


def type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`: imports for types only, which cost nothing at run time."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def imports_of(tree: ast.AST, top_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every absolute import outside `if TYPE_CHECKING:`, at every
    level (function bodies aside with top_only). `from a import b` gives both a and
    a.b: b may be a module (`from nvctk.base import fileio`)."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if type_checking_block(node):
            return
        if top_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out
