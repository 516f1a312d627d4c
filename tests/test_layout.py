"""The file's shape, as SPEC fixes it ("It is built to be audited") and issue 22 asks.

An auditor reads agentgate.py's decision core first and may stop there: so every section says
how it reads, the core comes first, then the libraries, then what surrounds the core; no
section of the core reaches into a section below it except a library (whose contract its
header states); and the docstring's table of contents tells the truth about each section's
label and length. These read the file as text and its syntax tree; they run nothing. After
an edit that changes a section's length, `python3 tests/update_toc.py` writes the new counts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "agentgate.py"
LABELS = ("decision core", "library", "around the core")
BANNER = "# " + "=" * 93


def sections(lines):
    """(number, title, label, first line, last line) of each section, 1-based lines."""
    found = []
    for i, line in enumerate(lines):
        m = re.fullmatch(r"# (\d+)\. (.+)", line)
        if m and i and lines[i - 1] == BANNER:
            label = next((x[len("# Reads as: "):] for x in lines[i:i + 4]
                          if x.startswith("# Reads as: ")), None)
            found.append([int(m.group(1)), m.group(2), label, i])  # the banner's line
    for k, section in enumerate(found):
        section.append(found[k + 1][3] - 1 if k + 1 < len(found) else len(lines))
    return [tuple(s) for s in found]


def chars(lines):
    """Non-indent characters, as SPEC's budgets count them."""
    return sum(len(line.lstrip()) for line in lines)


def top_level_names(tree):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id, node


def read():
    text = SOURCE.read_text()
    return text, text.splitlines(), ast.parse(text)


def test_every_section_says_how_it_reads_and_the_core_comes_first():
    _, lines, _ = read()
    found = sections(lines)
    assert [s[0] for s in found] == list(range(1, len(found) + 1))
    labels = [s[2] for s in found]
    assert all(label in LABELS for label in labels), labels
    # core, then libraries, then around the core: the label never goes back up the list
    order = [LABELS.index(label) for label in labels]
    assert order == sorted(order), labels
    assert labels[0] == "decision core" and "library" in labels


def test_the_table_of_contents_names_each_section_with_its_label_and_length():
    _, lines, tree = read()
    docstring = ast.get_docstring(tree, clean=False)
    for number, title, label, first, last in sections(lines):
        row = re.search(rf"^ +{number}\. (.+?) +({'|'.join(LABELS)})"
                        rf" +(\d+) +([\d,]+)$", docstring, re.M)
        assert row, f"section {number} is not in the table of contents"
        assert title.startswith(row.group(1).strip()), (title, row.group(1))
        assert row.group(2) == label
        assert int(row.group(3)) == last - first + 1, (number, title)
        size = chars(lines[first:last + 1])
        assert int(row.group(4).replace(",", "")) == size, (number, title)
    core = sum(last - first + 1 for _, _, label, first, last in sections(lines)
               if label == "decision core")
    assert re.search(rf"\b{core} lines of decision core\b", docstring)


def test_the_core_reaches_below_itself_only_into_libraries():
    _, lines, tree = read()
    found = sections(lines)

    def section_of(lineno):
        above = [s for s in found if s[3] < lineno]
        return max(above, key=lambda s: s[3]) if above else (0, "", "", 0, 0)

    defined = {}
    for name, node in top_level_names(tree):
        defined.setdefault(name, section_of(node.lineno))
    reaches = set()
    for name, node in top_level_names(tree):
        here = section_of(node.lineno)
        if here[2] != "decision core":
            continue
        for used in ast.walk(node):
            if isinstance(used, ast.Name) and used.id in defined and used.id != name:
                there = defined[used.id]
                if there[0] > here[0] and there[2] != "library":
                    reaches.add((here[1], used.id, there[1]))
    assert not reaches, sorted(reaches)


def test_the_journey_map_names_functions_that_exist():
    _, _, tree = read()
    docstring = ast.get_docstring(tree, clean=False)
    journey = docstring[docstring.index("One tools/call through the core"):]
    named = set(re.findall(r"\b([A-Z][A-Za-z]+)\.([a-z_]+)\b", journey))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert named
    for cls, method in named:
        assert cls in classes, cls
        methods = {n.name for n in classes[cls].body if isinstance(n, ast.FunctionDef)}
        assert method in methods, f"{cls}.{method}"
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name in re.findall(r"(?<![.\w])([a-z]+_[a-z_]+)\b", journey):
        assert name in functions, name


def test_no_line_is_longer_than_a_hundred_characters():
    _, lines, _ = read()
    assert [i for i, line in enumerate(lines, 1) if len(line) > 100] == []


def header(lines, section):
    """The comment block that opens a section, as one string."""
    first = section[3]
    block = []
    for line in lines[first:]:
        if line == BANNER:
            break
        block.append(line[2:] if line.startswith("# ") else "")
    return "\n".join(block)


def core_calls(text):
    """The names a header's `Core it calls:` paragraph lists."""
    m = re.search(r"Core it calls:(.*?)(?=\n[A-Z][a-z ]+:|\Z)", text, re.S)
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", m.group(1))) if m else set()


def test_what_surrounds_the_core_reaches_it_only_through_what_its_header_names():
    """Past the framing and text helpers of the first two sections (the JSON helpers are a
    library), an exception class or a constant, a section around the core uses only the core
    functions and classes its header lists; and no section uses another's private name."""
    _, lines, tree = read()
    found = sections(lines)

    def section_of(lineno):
        above = [s for s in found if s[3] < lineno]
        return max(above, key=lambda s: s[3]) if above else None

    defined = {}
    for name, node in top_level_names(tree):
        defined.setdefault(name, section_of(node.lineno))
    unnamed, private = set(), set()
    for name, node in top_level_names(tree):
        here = section_of(node.lineno)
        if here is None:
            continue
        listed = core_calls(header(lines, here))
        for used in ast.walk(node):
            if not isinstance(used, ast.Name) or used.id == name:
                continue
            there = defined.get(used.id)
            if there is None or there == here:
                continue
            if used.id.startswith("_"):
                private.add((here[1], used.id))
            if here[2] != "around the core" or there[2] != "decision core" or there[0] <= 2:
                continue
            if used.id.isupper() or used.id.endswith("Error") or used.id in listed:
                continue
            unnamed.add((here[1], used.id))
    assert not private, sorted(private)
    assert not unnamed, sorted(unnamed)
