"""agentgate.py binds each top-level name once: a second binding (two sections each defining a
WAITING query, say) silently replaces the first for every caller, which is how one merge made
every held call fail to record. Methods of a class likewise."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "agentgate.py"


def bound(body):
    names = collections.defaultdict(list)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name].append(node.lineno)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id].append(node.lineno)
    return {name: lines for name, lines in names.items() if len(lines) > 1}


def test_each_top_level_name_and_method_is_bound_once():
    tree = ast.parse(SOURCE.read_text())
    twice = bound(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            twice.update({f"{node.name}.{name}": lines
                          for name, lines in bound(node.body).items()})
    assert not twice, twice
