"""The documentation's examples are tested: every shown output is what the code prints today.

Convention (docs/development.md, "Documentation"): a fenced block whose info string is ``console``
holds one or more examples, each a line ``$ harness <command> ...`` followed by the output that
command prints (stdout and stderr, as a terminal shows them). Each command runs here as
``python -m harness`` with the argument list from ``shlex.split`` (no shell), cwd the repository root,
and its output must equal the block's, line for line, with two explicit allowances:

* a line that is exactly ``...`` stands for any number of lines (the block shows the part that
  matters; everything it does show must match exactly);
* NORMALISE below: the few values that are facts of the environment, not of the code's answer
  (a run's wall time, torch's version, the git commit), each by a pattern that matches only its line.

``console slow`` blocks run only under ``-m slow`` (long real runs). A ``text`` block is never run: it
holds output that cannot be deterministic (timings), and the page says it is illustrative.

``harness run`` and ``harness sweep`` write rows: the test passes ``results_dir=`` a temporary folder
(replacing the block's own), so that running the docs never writes into the checkout.
Also here: docs/commands.md is what ``scripts/gen_docs.py`` generates, and every relative link in
README.md and docs/ names a file that exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
WRITES_ROWS = ("run", "sweep")  # commands whose rows go to a temporary results_dir here
TIMEOUT_S = 120

# Environment facts, not answers: (pattern of the whole line, what both sides become). Narrow on
# purpose: each names the one line the runner prints about its environment.
NORMALISE = [
    (
        re.compile(r"^wall \d+(\.\d+)? s; torch \S+; git \S+$"),
        "wall <seconds> s; torch <version>; git <commit>",
    ),
]


class Example(NamedTuple):
    page: str
    line: int  # of the ``$ harness`` line, 1-based
    command: str
    expected: list[str]
    slow: bool


def _examples(page: Path) -> list[Example]:
    out: list[Example] = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```console"):
            i += 1
            continue
        slow = "slow" in fence.split()[1:]
        body_start = i + 1
        j = body_start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        assert j < len(lines), f"{page.name}:{i + 1}: a console block that is never closed"
        current: Example | None = None
        for k in range(body_start, j):
            if lines[k].startswith("$ "):
                if current:
                    out.append(current)
                current = Example(str(page.relative_to(ROOT)), k + 1, lines[k][2:], [], slow)
            elif current is None:
                raise AssertionError(f"{page.name}:{k + 1}: a console block must start with '$ harness'")
            else:
                current.expected.append(lines[k])
        if current:
            out.append(current)
        i = j + 1
    return out


EXAMPLES = [e for page in PAGES for e in _examples(page)]


def _normalise(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = line.rstrip()
        for pattern, replacement in NORMALISE:
            if pattern.match(line):
                line = replacement
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def _matches(expected: list[str], actual: list[str]) -> bool:
    """Line-for-line equality, where an expected ``...`` line matches any run of lines (doctest's
    ELLIPSIS, by whole lines)."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[n:]) for n in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and _matches(expected[1:], actual[1:])


def _argv(command: str, tmp_path: Path) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "harness", f"an example runs harness, not {words[0]!r}"
    args = words[1:]
    if args and args[0] in WRITES_ROWS:
        args = [a for a in args if not a.startswith("results_dir=")] + [f"results_dir={tmp_path}"]
    return [sys.executable, "-m", "harness", *args]


def _param(e: Example):
    marks = [pytest.mark.slow] if e.slow else []
    return pytest.param(e, id=f"{e.page}:{e.line}", marks=marks)


def test_the_docs_have_examples():
    assert len(EXAMPLES) >= 10, [e.command for e in EXAMPLES]


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES])
def test_example_prints_what_the_docs_show(example: Example, tmp_path):
    env = {**os.environ, "COLUMNS": "120", "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        _argv(example.command, tmp_path),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, as a terminal shows it
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    actual = _normalise(done.stdout.split("\n"))
    expected = _normalise(example.expected)
    if not _matches(expected, actual):
        shown = "\n".join(actual)
        pytest.fail(
            f"{example.page}:{example.line}: `{example.command}` (exit {done.returncode}) now prints:\n"
            f"{shown}\n--- the docs show:\n" + "\n".join(expected),
            pytrace=False,
        )


def test_commands_page_is_generated_from_the_help():
    done = subprocess.run(
        [sys.executable, "scripts/gen_docs.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_existing_files(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are not links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"
