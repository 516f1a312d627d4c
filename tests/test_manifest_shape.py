"""A manifest edited by hand into a shape pin never writes is refused with a sentence, as a
config is: `check`, `pin -diff` and serving say which tool's which part to re-pin, and no
traceback reaches the operator (found while cutting the core: an entry's annotations that were
a number, or an entry that was a list, crashed the load)."""

from __future__ import annotations

import json

import pytest

import kit

BROKEN = {
    "annotations": ("annotations", 5),
    "description": ("description", 3),
    "title": ("title", ["a"]),
    "icons": ("icons", {"src": "x"}),
    "_meta": ("_meta", [1]),
    "output_schema": ("output_schema", "x"),
}


def broken_manifest(tmp_path, part, value):
    config = kit.bank(tmp_path)
    assert kit.pin(config).returncode == 0
    path = tmp_path / "bank.manifest.json"
    manifest = json.loads(path.read_text())
    name = sorted(manifest["tools"])[0]
    if part == "entry":
        manifest["tools"][name] = [1]
    else:
        manifest["tools"][name][part] = value
    kit.write_private(path, json.dumps(manifest))
    return config, name


@pytest.mark.parametrize("part", sorted(BROKEN) + ["entry"])
def test_check_names_the_tool_and_part_of_a_hand_edited_manifest(tmp_path, part):
    key, value = BROKEN.get(part, ("entry", None))
    config, name = broken_manifest(tmp_path, key, value)
    result = kit.check(config)
    said = result.stdout + result.stderr
    assert result.returncode == 1
    assert "Traceback" not in said
    assert f'the {part} of tool "{name}" is not what pin writes; run pin again' in said


def test_pin_diff_and_serving_refuse_it_without_a_traceback(tmp_path):
    config, name = broken_manifest(tmp_path, "annotations", 5)
    diff = kit.agentgate("pin", "-diff", "-config", str(config))
    assert "Traceback" not in diff.stdout + diff.stderr
    said = diff.stdout + diff.stderr
    assert f'the annotations of tool "{name}" is not what pin writes' in said
    with kit.host(config) as host:
        listed = [tool.name for tool in host.list_tools()]
    assert listed and not any(tool.startswith("bank") for tool in listed)
