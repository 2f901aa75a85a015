"""PR text: each entry's ``message.md`` read against upstream's own PR rules.

The rules come from the pristine release, not from copies kept here:
``.github/PULL_REQUEST_TEMPLATE.md`` gives the sections (its ``## `` headings,
in order) and ``AGENTS.md`` asks AI-assisted PRs to say so. A message must
also be readable in a plain vLLM checkout, so it may not name a path that only
this repository has (the workbench, ``project/``, ``patches/``, the
materialized tree), and must be short enough to be read: at most
``MAX_WORDS`` words.
"""

from __future__ import annotations

import re
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.stack import MESSAGE, Entry

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
_HEADING = re.compile(r"(?m)^## +(.+?)\s*$")
# Paths and commands a vLLM checkout does not have. "vllm-project/" (GitHub
# links) is not "project/": the character before it must not be part of a name.
PROJECT_ONLY = (
    (re.compile(r"(?<![\w/.-])\./wb\b|(?<![\w/.-])wb (?=[a-z])"), "the workbench"),
    (re.compile(r"(?<![\w/.-])project/"), "project/"),
    (re.compile(r"(?<![\w/.-])patches/"), "patches/"),
    (re.compile(r"(?<![\w/.-])build/(?:vllm|regress-tree|venv|export)\b"), "build/"),
)
_AI_DISCLOSURE = re.compile(r"(?i)\bAI[- ]assist")
# A usual vLLM PR description, template included, is 100-300 words.
MAX_WORDS = 400


def word_count(message: str) -> int:
    """Words of a PR text as ``wc -w`` counts them: whitespace-separated runs.

    Everything counts, code blocks and the template's checklist included: the
    limit is what a reviewer reads, and a reviewer reads the commands to run as
    much as the prose (an exempt code block is also where a pasted log or a
    design argument would hide). So ``wc -w message.md`` gives the same number.
    """
    return len(message.split())


def template_headings(pristine: Path) -> list[str]:
    """The ``## `` section headings of the release's PR template, in order."""
    template = pristine / TEMPLATE
    if not template.is_file():
        raise WorkbenchError(
            f"the pristine tree has no {TEMPLATE}; the PR text cannot be checked"
        )
    headings = template_headings_of(template.read_text())
    if not headings:
        raise WorkbenchError(f"{TEMPLATE} of the pristine tree has no '## ' headings")
    return headings


def template_headings_of(text: str) -> list[str]:
    """The ``## `` headings of a PR template's text, in order."""
    return list(_HEADING.findall(text))


def message_problems(entry: Entry, headings: list[str]) -> list[str]:
    """Why ``entry``'s PR text does not follow the template (empty: it does)."""
    where = f"patches/{entry.name}/{MESSAGE}"
    # Code blocks may quote anything (a heading of another document, a path).
    text = re.sub(r"(?ms)^```.*?^```", "", entry.message)
    text = re.sub(r"(?m)^(?: {4}|\t).*$", "", text)
    problems = []
    words = word_count(entry.message)
    if words > MAX_WORDS:
        problems.append(
            f"{where}: {words} words (wc -w), over the {MAX_WORDS} a PR text may "
            "have; keep what and why, the upstream thread answered and the "
            "commands a reviewer runs, and move the design argument to the "
            "entry's docs/design/ page"
        )
    found = _HEADING.findall(text)
    if [h for h in found if h in headings] != headings:
        problems.append(
            f"{where}: its '## ' sections are {found or 'none'}; upstream's "
            f"{TEMPLATE} asks for {headings}, each once, in that order"
        )
    if not _AI_DISCLOSURE.search(text):
        problems.append(
            f"{where}: says nothing of AI assistance; AGENTS.md asks AI-assisted "
            "PRs to state it (the template's checklist has the box)"
        )
    for lineno, line in enumerate(entry.message.splitlines(), 1):
        for pattern, what in PROJECT_ONLY:
            if pattern.search(line):
                problems.append(
                    f"{where} line {lineno}: names {what}, which a vLLM checkout "
                    f"does not have: {line.strip()[:100]}"
                )
    return problems
