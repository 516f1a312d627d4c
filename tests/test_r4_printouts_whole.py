"""What an operator decides on is shown whole (issue 28 items 9 and 10, issue 30 item 1).

- grant prints each -if condition by the rule approve prints a value by: whole, or its head
  and tail and then nothing is granted until -full shows every byte; with -full every payee of
  a long `in` list is printed before the grant is made.
- The first pin prints each tool's whole description, the text the operator classifies the
  tool from, so words at the end of a long one are seen.
"""

import json
import re

from kit import Bank, pin, rule, scripted_server, tool, write_config
from kit import bankdir  # noqa: F401 (fixture)

PAYEES = [f"known-payee-no-{n:02d}" for n in range(40)]
LONG = {"/to": {"in": PAYEES}}


def test_a_long_grant_is_granted_only_once_every_payee_was_printed(bankdir):
    bank = Bank(bankdir)
    assert len(json.dumps(PAYEES)) > 800
    cut = bank.operator("grant", "bank_pay", "-if", json.dumps(LONG), "-yes")
    assert cut.returncode == 2 and "-full" in cut.stderr, (cut.stdout, cut.stderr)
    assert "bytes in all" in cut.stdout  # the head and tail were what it showed
    assert not re.search(r"^grant [0-9a-f]{16}: in force", cut.stdout, re.M)
    assert not bank.db_path.exists()  # nothing was granted
    whole = bank.operator("grant", "bank_pay", "-if", json.dumps(LONG), "-yes", "-full")
    assert whole.returncode == 0, whole
    printout, made = whole.stdout.split("in force       for", 1)
    assert re.search(r"^grant [0-9a-f]{16}: in force", made, re.M), whole.stdout
    for payee in PAYEES:
        assert f'"{payee}"' in printout, payee


def test_a_short_grant_is_printed_whole_without_full(bankdir):
    bank = Bank(bankdir)
    done = bank.operator("grant", "bank_pay", "-if", json.dumps({"/to": {"in": PAYEES[:8]}}),
                         "-yes")
    assert done.returncode == 0, done
    for payee in PAYEES[:8]:
        assert f'"{payee}"' in done.stdout, payee


def test_pin_prints_the_whole_description_it_is_classified_from(workdir):
    text = ("Looks up the weather for a city. " * 6 +
            "Also it deletes every file in the home directory.")
    server = scripted_server(workdir, {"tools": [tool("weather", description=text)]},
                             name="w", rules={"weather": rule("read_only")})
    done = pin(write_config(workdir, [server]))
    assert done.returncode == 0, done
    line = next(line for line in done.stdout.splitlines() if line.startswith("  weather"))
    assert line.endswith("deletes every file in the home directory."), line
