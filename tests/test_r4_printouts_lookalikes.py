"""Values written wholly in lookalike letters are marked (issue 28 item 11).

A payee spelled in Cyrillic letters that read as Latin ones (`раураӏ` reads "paypal") mixes no
scripts, yet is made to be read as another name: approve marks it, as UTS #39 marks a
whole-script confusable, beside the words that mix scripts it marked already.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agentgate  # noqa: E402
from kit import Bank  # noqa: E402
from kit import bankdir  # noqa: E402,F401 (fixture)

PAYPAL = "\u0440\u0430\u0443\u0440\u0430\u04cf"  # раураӏ, all Cyrillic


def test_approve_marks_a_payee_written_wholly_in_cyrillic_lookalikes(bankdir):
    bank = Bank(bankdir)
    host = bank.start()
    run, _ = bank.pending(bank.call(host, {"to": PAYPAL, "amount": 5}))
    shown = bank.approve(run, None, ok=False)  # no terminal: the printout, then a refusal
    assert shown.returncode == 2 and "end of approval" in shown.stdout, shown
    caution = [line for line in shown.stdout.splitlines() if "CAUTION" in line]
    assert any('reads as the Latin "paypal"' in line and "CYRILLIC" in line
               for line in caution), shown.stdout
    assert bank.payments() == 0


def test_whole_script_lookalikes_are_found_and_plain_words_are_not():
    found = agentgate.lookalike_words(
        "send to \u0430\u0440\u0440\u04cf\u0435.com or l\u0430ndlord; "
        "\u041c\u043e\u0441\u043a\u0432\u0430 \u0441 \u043e paypal \u03bf\u03bd\u03bf")
    # аррӏе (apple), the mixed lаndlord, Greek ονο; not Москва, one-letter words or Latin.
    assert found == sorted(["\u0430\u0440\u0440\u04cf\u0435", "l\u0430ndlord",
                            "\u03bf\u03bd\u03bf"]), found
    assert agentgate.latin_lookalike(PAYPAL) == "paypal"


def test_the_lint_marks_a_tool_named_or_described_in_lookalikes():
    named = agentgate.lint_tool({"name": PAYPAL, "description": "Pays.", "input_schema": {}},
                                [], [], 10)
    assert ("high", "a name in letters that read as Latin ones",
            f'name "{PAYPAL}"') in named, named
    said = agentgate.lint_tool({"name": "pay", "description": f"Pays {PAYPAL}.",
                                "input_schema": {}}, [], [], 10)
    assert any(severity == "high" and PAYPAL in what for severity, what, _ in said), said
