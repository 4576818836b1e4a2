"""Answer the real, interactive `accelerate config` at a pseudo-terminal, as a user would.

Each question is answered by its words: `answers` maps words that must appear in a question to
the answer (for a menu, words of the option to pick, chosen with its number key as a user may;
for a typed question, the text).  A question that no entry matches fails the test with the
question's text: a reworded question must not get the answer meant for another.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

MENU_HINT = "Please select a choice using the arrow or number keys"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
QUIET_SECONDS = 0.4  # no output for this long: the program waits for an answer


def _plain(text: str) -> list[str]:
    lines = ANSI.sub("", text.replace("\r", "\n")).split("\n")
    return [line.replace("➔", "").strip().lstrip("-") for line in lines if line.strip()]


def _question(lines: list[str]) -> tuple[str, list[str]] | None:
    """(the question, the menu's options or [] for a typed answer) of what was printed since the
    last answer; None when it does not end in a question (the closing "configuration saved")."""
    if any(MENU_HINT in line for line in lines):
        hint = max(i for i, line in enumerate(lines) if MENU_HINT in line)
        return lines[hint - 1], lines[hint + 1:]
    if lines and lines[-1].endswith(("?", ":", "]")):
        return lines[-1], []
    return None


def _answer(question: str, options: list[str], answers: dict[str, str]) -> str:
    matches = [words for words in answers if words.lower() in question.lower()]
    if len(matches) != 1:
        raise AssertionError(f"accelerate config asked {question!r}: {len(matches)} of the "
                             f"prepared answers match it ({matches or list(answers)})")
    answer = answers[matches[0]]
    if not options:
        return answer + "\r"
    picked = [i for i, option in enumerate(options) if answer.lower() == option.lower()] or \
        [i for i, option in enumerate(options) if answer.lower() in option.lower()]
    if len(picked) != 1 or picked[0] > 9:
        raise AssertionError(f"accelerate config asked {question!r} with options {options}: "
                             f"the answer {answer!r} matches {len(picked)} of them")
    return f"{picked[0]}\r"


def answer_accelerate_config(config_file: Path, answers: dict[str, str], env: dict,
                             timeout: float = 120) -> list[tuple[str, str]]:
    """Run `accelerate config --config_file FILE` at a terminal; return (question, answer) in
    the order asked.  Every prepared answer must have been used."""
    leader, follower = pty.openpty()
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "config",
           "--config_file", str(config_file)]
    proc = subprocess.Popen(cmd, stdin=follower, stdout=follower, stderr=follower, env=env,
                            start_new_session=True)
    os.close(follower)
    asked, pending, last_output = [], "", time.monotonic()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"accelerate config still running after {timeout} s; "
                                     f"last output {_plain(pending)[-5:]}")
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(leader, 4096).decode(errors="replace")
                except OSError:  # the program closed the terminal: it has finished
                    break
                pending += chunk
                last_output = time.monotonic()
                continue
            if pending.strip() and time.monotonic() - last_output > QUIET_SECONDS:
                prompt = _question(_plain(pending))
                if prompt is None:
                    continue
                question, options = prompt
                reply = _answer(question, options, answers)
                asked.append((question, reply.strip()))
                os.write(leader, reply.encode())
                pending = ""
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    assert proc.returncode == 0, f"accelerate config exited {proc.returncode}: {asked}"
    unused = set(answers) - {words for words in answers
                             for question, _ in asked if words.lower() in question.lower()}
    assert not unused, f"prepared answers never asked for: {sorted(unused)}; asked: {asked}"
    return asked
