#!/usr/bin/env python3
"""Rewrite the line counts of agentgate.py's table of contents, run by hand after an edit:
python3 tests/update_toc.py

test_layout.py checks that the docstring tells each section's lines and characters and the
core's total as the file has them; this writes those numbers (and nothing else) from the file.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_layout import SOURCE, chars, sections  # noqa: E402


def main():
    text = SOURCE.read_text()
    lines = text.splitlines()
    found = sections(lines)
    for number, title, label, first, last in found:
        row = re.compile(rf"^ +{number}\. .+$", re.M)
        size = chars(lines[first:last + 1])
        text, changed = row.subn(f"    {number:2}. {title[:44]:44} {label:16} "
                                 f"{last - first + 1:5} {size:8,}", text, count=1)
        if not changed:
            sys.exit(f"section {number} ({title}) has no row in the table of contents")
    core = sum(last - first + 1 for _, _, label, first, last in found if label == "decision core")
    text = re.sub(r"\b\d+ lines of decision core\b", f"{core} lines of decision core", text, count=1)
    SOURCE.write_text(text)
    print(f"{len(found)} sections, {core} lines of decision core")


if __name__ == "__main__":
    main()
