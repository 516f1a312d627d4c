"""`agentgate.py watch`: the live view of what waits for an operator, and its plain lines.

The terminal tests run watch in a real terminal: a tmux server of the test's own (its own
socket, killed when the test ends), a fixed size, keys sent with send-keys, the screen read
with capture-pane. Each waits on what the screen shows, never on a fixed time. Behind watch
is a real gate in front of the fake bank, with the SDK host making a payment that waits.
"""

import itertools
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
from contextlib import suppress

import pytest

from conftest import agentgate_argv, children, wait_for
from kit import DEADLINE, Bank, agentgate, bankdir, event_parts, reap, wait_gone  # noqa: F401 (bankdir is a fixture)

TMUX = "/usr/bin/tmux"
SCREEN = 30.0  # seconds a screen may take to show what it is waited for (a loaded machine)
KIM = {"to": "kim", "amount": 5}
_names = itertools.count()


class Terminal:
    """A command in a 140x45 tmux pane of a tmux server of its own. When the command ends the
    pane says how, and waits: the exit status is read from the screen."""

    def __init__(self):
        self.name = f"agentgate-watch-{os.getpid()}-{next(_names)}"
        self.socket, self.pids = "", []

    def start(self, argv, cwd) -> "Terminal":
        # The shell outlives an interrupt sent to the pane (C-c), to say how the command ended.
        command = f"trap : INT; {shlex.join(argv)}; echo \"watch exited $?\"; read -r _"
        self.tmux("-f", "/dev/null", "new-session", "-d", "-x", "140", "-y", "45", "-c", str(cwd),
                  "sh", "-c", command)
        self.socket, server, pane = self.tmux("display-message", "-p", "#{socket_path} #{pid} #{pane_pid}").split()
        self.pids = [int(server), int(pane)]
        return self

    def tmux(self, *args: str) -> str:
        # LINES and COLUMNS (pytest's workers set COLUMNS) would override the pane's size.
        env = {k: v for k, v in os.environ.items() if k not in ("LINES", "COLUMNS")}
        done = subprocess.run([TMUX, "-u", "-L", self.name, *args], capture_output=True, text=True,
                              timeout=DEADLINE, env={**env, "LANG": "C.UTF-8"})
        assert done.returncode == 0, f"tmux {args} exited {done.returncode}: {done.stderr}"
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p")

    def selected(self) -> str:
        """The row shown in reverse video ('' if none), without its escapes."""
        rows = self.tmux("capture-pane", "-p", "-e").splitlines()
        row = next((row for row in rows if re.search(r"\x1b\[([0-9;]*;)?7[;m]", row)), "")
        return re.sub(r"\x1b\[[0-9;]*m", "", row)

    def keys(self, *keys: str) -> None:
        """Keys by tmux's names (Enter, Escape, Up), each sent on its own."""
        for key in keys:
            self.tmux("send-keys", key)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-l", text)

    def until(self, holds, what: str) -> str:
        """Wait until `holds(screen)`; return that screen."""
        def found():
            screen = self.screen()
            return screen if holds(screen) else None
        try:
            return wait_for(found, SCREEN, interval=0.1, message=what)
        except AssertionError:
            raise AssertionError(f"the screen never showed {what}; it shows:\n{self.screen()}") from None

    def shows(self, *texts: str, absent: tuple = ()) -> str:
        """Wait until the screen shows every one of `texts` and none of `absent`; return it."""
        return self.until(lambda screen: all(text in screen for text in texts)
                          and not any(text in screen for text in absent), f"{texts} without {absent}")

    def close(self) -> None:
        """End the tmux server, and wait until it, the pane's shell and watch under it are gone."""
        left = [*self.pids, *children(self.pids[1])] if self.pids else []
        with suppress(Exception):
            subprocess.run([TMUX, "-L", self.name, "kill-server"], capture_output=True, timeout=DEADLINE)
        if self.socket:
            with suppress(OSError):
                os.unlink(self.socket)
        try:
            wait_gone(left, SCREEN, "the terminal's processes to end")
        finally:
            reap(left)


@pytest.fixture
def terminals():
    opened = []

    def start(argv, cwd):
        opened.append(Terminal())
        return opened[-1].start(argv, cwd)
    yield start
    for terminal in opened:
        terminal.close()


def waiting_bank(workdir, args=KIM):
    """A gate in front of the fake bank with one payment waiting: (bank, host, run, approval)."""
    bank = Bank(workdir)
    host = bank.start()
    run, approval = bank.pending(bank.call(host, args))
    return bank, host, run, approval


def watch(terminals, bank, by="tester"):
    return terminals(agentgate_argv("watch", "-config", str(bank.config), "-by", by), bank.dir)


def opened_in_watch(workdir, terminals, args=KIM, by="tester"):
    """A payment that waits, opened in watch: (bank, host, run, approval, terminal)."""
    bank, host, run, approval = waiting_bank(workdir, args)
    terminal = watch(terminals, bank, by)
    terminal.shows(run)
    terminal.keys("Enter")
    terminal.shows(f"end of approval {approval}")
    return bank, host, run, approval, terminal


def approve_printout(bank, run) -> list[str]:
    """The lines `approve` prints for the run's waiting approval (refusing, as stdin is no terminal)."""
    shown = bank.approve(run, None, ok=False)
    assert shown.returncode == 2 and "end of approval" in shown.stdout, shown
    return shown.stdout.rstrip("\n").splitlines()


def test_watch_lists_what_waits_and_opens_it_as_approve_prints_it(bankdir, terminals):
    bank, host, run, approval = waiting_bank(bankdir)
    terminal = watch(terminals, bank)
    listed = terminal.shows(run, "bank_pay")
    row = next(line for line in listed.splitlines() if run in line)
    assert row.startswith(approval) and "bank_pay" in row and '"to":"kim"' in row, listed
    assert "1 waiting for an operator in session test, deciding as tester" in listed

    printed = approve_printout(bank, run)
    terminal.keys("Enter")

    def as_printed(screen):
        rows = [line.rstrip() for line in screen.splitlines()]
        return printed[0] in rows and rows[rows.index(printed[0]):][:len(printed)] == printed
    terminal.until(as_printed, "the approval as approve prints it:\n" + "\n".join(printed))

    terminal.keys("q")
    terminal.shows("waiting for an operator", "ARGUMENTS")
    terminal.keys("q")
    terminal.shows("watch exited 0")
    assert bank.approval(approval)["status"] == "pending"
    assert bank.payments() == 0


def test_the_selection_stays_on_its_approval_while_others_stop_waiting(bankdir, terminals):
    bank = Bank(bankdir)
    host = bank.start()
    waiting = [bank.pending(bank.call(host, {"to": to, "amount": 1})) for to in ("ann", "bea", "cy")]
    terminal = watch(terminals, bank)
    terminal.shows(*(run for run, _ in waiting))
    (first_run, _), (second_run, second) = waiting[0], waiting[1]
    wait_for(lambda: first_run in terminal.selected(), SCREEN, 0.1, "the first row to be selected")
    terminal.keys("Down")
    wait_for(lambda: second_run in terminal.selected(), SCREEN, 0.1, "the second row to be selected")
    bank.reject(first_run, "not ann")
    terminal.shows("2 waiting for an operator", absent=(first_run,))
    wait_for(lambda: second_run in terminal.selected(), SCREEN, 0.1, "the second row to stay selected")
    terminal.keys("Enter")
    terminal.shows(f"APPROVAL WAITING  {second}", '"bea"')


def test_watch_approves_with_a_key_and_the_retry_pays_once(bankdir, terminals):
    bank, host, run, approval, terminal = opened_in_watch(bankdir, terminals, by="joey")
    terminal.keys("a")
    terminal.shows(f"approval {approval}: approved by joey", "nothing waits")

    stored = bank.approval(approval)
    assert stored["status"] == "approved" and stored["decided_by"] == "joey", stored
    assert bank.call(host, KIM).text == "paid 5.00 to kim"
    bank.call(host, KIM)  # the same call once more: it was executed, it is not again
    assert bank.payments() == 1
    terminal.keys("C-c")  # an interrupt ends watch quietly
    assert "Traceback" not in terminal.shows("watch exited 0")


def test_watch_rejects_with_a_note_the_model_is_shown(bankdir, terminals):
    bank, host, run, approval, terminal = opened_in_watch(bankdir, terminals)
    terminal.keys("r")
    terminal.shows("note for the model")
    terminal.keys("Enter")  # a note is required: an empty one rejects nothing
    terminal.type("not to kim, ask me first")
    terminal.shows("ask me first_")
    assert bank.approval(approval)["status"] == "pending"
    terminal.keys("Enter")
    terminal.shows(f"approval {approval}: rejected by tester", "nothing waits")

    stored = bank.approval(approval)
    assert stored["status"] == "rejected" and stored["note"] == "not to kim, ask me first", stored
    answer = bank.call(host, KIM)
    assert answer.prefix == "REJECTED" and "not to kim, ask me first" in answer.text, answer
    assert bank.payments() == 0


def test_an_approval_decided_elsewhere_after_it_was_shown_is_not_decided_in_watch(bankdir, terminals):
    bank, host, run, approval, terminal = opened_in_watch(bankdir, terminals)
    bank.reject(run, "decided at another terminal")

    terminal.keys("a")
    screen = terminal.shows(f"approval {approval} changed after it was shown", "nothing was decided")
    assert "approved by" not in screen
    stored = bank.approval(approval)
    assert stored["status"] == "rejected" and stored["note"] == "decided at another terminal", stored
    decided = [part for row in bank.query("SELECT type, step_id, payload_json FROM events")
               for part in event_parts(*row) if part[0] == "approval.decided"]
    assert len(decided) == 1
    assert bank.call(host, KIM).prefix == "REJECTED"
    assert bank.payments() == 0


def test_a_shortened_value_is_decided_only_once_shown_whole(bankdir, terminals):
    long = "x" * 600
    bank, host, run, approval, terminal = opened_in_watch(bankdir, terminals, {"to": long, "amount": 4})
    terminal.shows("[... 600 bytes in all ...]")
    terminal.keys("a")
    terminal.shows("press f to show every byte")
    assert bank.approval(approval)["status"] == "pending"

    terminal.keys("f")
    whole = terminal.shows("(600 bytes)", absent=("bytes in all", "press f"))
    assert "".join(whole.split()).count(long) == 1, whole
    terminal.keys("a")
    terminal.shows(f"approval {approval}: approved by tester")
    assert bank.call(host, {"to": long, "amount": 4}).text == f"paid 4.00 to {long}"
    assert bank.payments() == 1


def test_an_approval_longer_than_the_screen_is_decided_only_once_scrolled_to_its_end(bankdir, terminals):
    long = "".join(f"{i:05d}" for i in range(1600))  # 8000 bytes: 58 rows of the screen's 139 columns
    bank, host, run, approval, terminal = opened_in_watch(bankdir, terminals, {"to": long, "amount": 2})
    terminal.keys("f")
    terminal.shows("APPROVAL WAITING", 'to = "0000000001', absent=("end of approval",))
    terminal.keys("a")
    terminal.shows("scroll to the end of the approval before you decide")
    assert bank.approval(approval)["status"] == "pending"

    terminal.keys("Space")
    terminal.shows(f"end of approval {approval}", "(8000 bytes)", absent=("APPROVAL WAITING",))
    terminal.keys("a")
    terminal.shows(f"approval {approval}: approved by tester")
    assert bank.call(host, {"to": long, "amount": 2}).text == f"paid 2.00 to {long}"
    assert bank.payments() == 1


def test_control_and_bidi_characters_reach_the_terminal_only_as_text(bankdir, terminals):
    bank, host, run, approval = waiting_bank(bankdir, {"to": "\x1b[31mred\u202eevil\x07", "amount": 3})
    terminal = watch(terminals, bank)
    listed = terminal.shows(run, "\\u001b[31mred\\u{202e}evil\\u0007")
    terminal.keys("Enter")
    opened = terminal.shows(f"end of approval {approval}", 'to = "\\u001b[31mred\\u{202e}evil\\u0007"')
    for screen in (listed, opened):
        assert not any(ch in screen for ch in "\x1b\x07\u202e"), screen


def test_a_terminal_that_cannot_place_the_cursor_gets_plain_lines(bankdir, terminals):
    bank, host, run, approval = waiting_bank(bankdir)
    argv = ["env", "TERM=dumb", *agentgate_argv("watch", "-config", str(bank.config))]
    terminal = terminals(argv, bank.dir)
    terminal.shows("this terminal cannot show the live view", f"waiting  run {run}  approval {approval}")
    terminal.keys("Enter", "a")
    terminal.keys("C-c")
    assert "Traceback" not in terminal.shows("watch exited 0")
    assert bank.approval(approval)["status"] == "pending"


def plain_watch(bank):
    """watch with its output on a pipe: (process, a queue of its lines)."""
    proc = subprocess.Popen(agentgate_argv("watch", "-config", str(bank.config)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def next_line(lines) -> str:
    try:
        return lines.get(timeout=SCREEN)
    except queue.Empty:
        raise AssertionError(f"watch printed no line in {SCREEN}s") from None


def test_plain_lines_through_a_pipe_until_sigterm(bankdir):
    bank = Bank(bankdir)
    host = bank.start()
    host.list_tools()  # the gate has made its database
    proc, lines = plain_watch(bank)
    try:
        run, approval = bank.pending(bank.call(host, KIM))
        waiting = next_line(lines)
        assert re.match(rf"waiting  run {re.escape(run)}  approval {approval}  tool bank_pay  age \d+s  "
                        r'\{"amount":5,"to":"kim"\}  decide with: ', waiting), waiting
        command = waiting.split("decide with:", 1)[1].split("(or reject)")[0]
        pasted = subprocess.run([*shlex.split(command), "-by", "pat"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=DEADLINE)
        assert pasted.returncode == 0, pasted
        ended = next_line(lines)
        assert ended == f"ended    run {run}  approval {approval}  tool bank_pay  approved by pat\n", ended
        assert bank.call(host, KIM).text == "paid 5.00 to kim"

        run, approval = bank.pending(bank.call(host, {"to": "rex", "amount": 1}))
        assert f"approval {approval}  tool bank_pay" in next_line(lines)
        bank.reject(run, "not rex")
        ended = next_line(lines)
        assert ended.startswith(f"ended    run {run}  approval {approval}  tool bank_pay  rejected by "), ended
        assert ended.endswith(": not rex; run CANCELLED (approval_rejected)\n"), ended

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0
        assert proc.stderr.read() == ""
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert bank.payments() == 1


def test_watch_without_a_database_says_so_in_one_sentence(workdir):
    done = agentgate("watch", "-db", str(workdir / "none.db"))
    assert done.returncode == 1, done
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not (workdir / "none.db").exists()
