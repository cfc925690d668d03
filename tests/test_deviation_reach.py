"""Every deviation entry of spec/ says whether the engine's server reaches it (issue 30).

The format is spec/README.md's "Deviations and their reach": exactly one line
``**Reach:** <label> \u2014 <evidence>`` right after a ``## DEV-`` / ``### DEV-`` heading (or,
for an entry written as a paragraph that opens with ``**DEV-…``, right after that paragraph),
the label one of ``server``, ``beyond server``, ``adapter``, ``ours``. A ``server`` line cites
the call path as ``file.py:LINE``; a ``beyond server`` line names its guard's id in backticks
and cites where the guard is (``file.py:LINE``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SPEC = Path(__file__).resolve().parents[1] / "spec"

LABELS = ("server", "beyond server", "adapter", "ours")
DASH = "\u2014"  # the em dash between label and evidence

HEADING = re.compile(r"^#{1,6}\s")
DEV_HEADING = re.compile(r"^#{2,3} (DEV-[A-Za-z]*\d+)")
DEV_PARAGRAPH = re.compile(r"^\*\*(DEV-[A-Za-z]*\d+)\b")
FENCE = re.compile(r"^\s*(```|~~~)")
REACH_START = "**Reach:**"
REACH = re.compile(r"^\*\*Reach:\*\* (?P<label>.+?) " + DASH + r" (?P<evidence>\S.*)$", re.DOTALL)
CITATION = re.compile(r"\w\.py:\d+")
GUARD_ID = re.compile(r"\bguard(?: id)?:? `[a-z][a-z0-9]*(?:_[a-z0-9]+)*`")


@dataclass(frozen=True)
class Entry:
    """One deviation entry: its title line and the lines up to the next entry or heading."""

    ident: str  # DEV-…
    title: str
    paragraph: bool  # written as a bold paragraph, not under a heading
    lines: tuple[str, ...]  # the lines after the title line


def _is_boundary(line: str) -> bool:
    return bool(HEADING.match(line) or DEV_PARAGRAPH.match(line))


def entries(text: str) -> list[Entry]:
    """The deviation entries of one spec page, in order; fenced code is not read."""
    lines = text.split("\n")
    fenced = False
    starts: list[int] = []
    boundaries: list[int] = []
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        if _is_boundary(line):
            boundaries.append(i)
        if DEV_HEADING.match(line) or DEV_PARAGRAPH.match(line):
            starts.append(i)
    found = []
    for start in starts:
        end = next((b for b in boundaries if b > start), len(lines))
        heading = DEV_HEADING.match(lines[start])
        ident = (heading or DEV_PARAGRAPH.match(lines[start]))
        assert ident is not None
        found.append(Entry(ident=ident.group(1), title=lines[start].strip(),
                           paragraph=heading is None, lines=tuple(lines[start + 1:end])))
    return found


def _reach_paragraph(lines: tuple[str, ...], at: int) -> str:
    """The Reach line at ``at`` joined with the lines that continue its paragraph."""
    taken = [lines[at].strip()]
    for line in lines[at + 1:]:
        if not line.strip():
            break
        taken.append(line.strip())
    return " ".join(taken)


def _first_block_after_title(entry: Entry) -> int | None:
    """Index (in entry.lines) of the first line where the Reach line belongs."""
    i = 0
    if entry.paragraph:  # skip the rest of the entry's own paragraph
        while i < len(entry.lines) and entry.lines[i].strip():
            i += 1
    while i < len(entry.lines) and not entry.lines[i].strip():
        i += 1
    return i if i < len(entry.lines) else None


def entry_problems(entry: Entry) -> list[str]:
    """What is wrong with one entry's Reach line; empty when it is well formed."""
    at = [i for i, line in enumerate(entry.lines) if line.strip().startswith(REACH_START)]
    if not at:
        return ["no **Reach:** line"]
    if len(at) > 1:
        return [f"{len(at)} **Reach:** lines, expected exactly one"]
    problems = []
    if _first_block_after_title(entry) != at[0]:
        problems.append("the **Reach:** line is not the first thing after the "
                        + ("entry's paragraph" if entry.paragraph else "heading"))
    text = _reach_paragraph(entry.lines, at[0])
    match = REACH.match(text)
    if match is None:
        return [*problems, f"not of the form '**Reach:** <label> {DASH} <evidence>'"]
    label, evidence = match.group("label"), match.group("evidence")
    if label not in LABELS:
        problems.append(f"label {label!r} is not one of {', '.join(LABELS)}")
    if label in ("server", "beyond server") and not CITATION.search(evidence):
        problems.append(f"a {label!r} line cites no file.py:LINE")
    if label == "beyond server" and not GUARD_ID.search(evidence):
        problems.append("a 'beyond server' line names no guard id (guard `snake_case_id`)")
    return problems


def page_problems(name: str, text: str) -> list[str]:
    """Every problem of every deviation entry on one page, as 'page: title: problem'."""
    return [f"{name}: {entry.title}: {problem}"
            for entry in entries(text) for problem in entry_problems(entry)]


def _spec_pages() -> list[Path]:
    return sorted(SPEC.glob("*.md"))


def test_every_deviation_entry_has_exactly_one_well_formed_reach_line() -> None:
    problems = [p for page in _spec_pages() for p in page_problems(page.name, page.read_text())]
    assert not problems, (f"{len(problems)} problems with Reach lines (page: entry: problem):\n"
                          + "\n".join(problems))


def test_the_parser_finds_the_entries_of_every_family() -> None:
    # A parser that found nothing would pass the test above vacuously.
    found = {e.ident for page in _spec_pages() for e in entries(page.read_text())}
    for dev in ("DEV-1", "DEV-19", "DEV-32", "DEV-R3", "DEV-E1", "DEV-P1", "DEV-P3",
                "DEV-S26", "DEV-V11", "DEV-H9", "DEV-M11", "DEV-L2"):
        assert dev in found, f"{dev} was not found as a deviation entry"


def test_dev19_is_beyond_server_behind_reset_when_idle() -> None:
    # Issue 30: SGLang's flush_cache resets only when idle, so DEV-19 is not server-reachable.
    (entry,) = [e for e in entries((SPEC / "07-deviations.md").read_text())
                if e.ident == "DEV-19"]
    (line,) = [i for i, text in enumerate(entry.lines) if text.startswith(REACH_START)]
    reach = _reach_paragraph(entry.lines, line)
    assert reach.startswith(f"**Reach:** beyond server {DASH} guard `reset_when_idle`")


PLANTED = f"""# A page

## DEV-1 — good, server

**Reach:** server {DASH} design: `scheduler.py:10` → `cache.py:20`.

- **Seed:** x.

## DEV-2 — missing

- **Seed:** x.

### DEV-3 — two lines

**Reach:** ours {DASH} a choice.

**Reach:** ours {DASH} again.

## DEV-4 — unknown label

**Reach:** maybe {DASH} who knows.

## DEV-5 — server without a citation

**Reach:** server {DASH} design, somewhere in the scheduler.

## DEV-6 — beyond server without a guard id

**Reach:** beyond server {DASH} the scheduler refuses it (`scheduler.py:5`).

## DEV-7 — beyond server without a citation

**Reach:** beyond server {DASH} guard `reset_when_idle`, in the scheduler.

## DEV-8 — Reach after the bullets

- **Seed:** x.

**Reach:** ours {DASH} a choice.

## DEV-9 — a hyphen, not the dash

**Reach:** ours - a choice.

## DEV-10 — good, beyond server, wrapped

**Reach:** beyond server {DASH} guard `detach_when_idle`: the scheduler refuses a detach
while a prefetch is live (`scheduler.py:4961`).

```
## DEV-11 — inside a code fence, not an entry
```

## DEV-12 — good, adapter

**Reach:** adapter {DASH} the server calls `evict_for_alloc` instead.

**DEV-P1 (a paragraph entry, good).** Text of the entry
that goes on.

**Reach:** ours {DASH} a choice.

**DEV-P2 (a paragraph entry, missing).** Text.

## Not a deviation
"""

EXPECTED = {
    "DEV-2": "no **Reach:** line",
    "DEV-3": "2 **Reach:** lines",
    "DEV-4": "label 'maybe'",
    "DEV-5": "cites no file.py:LINE",
    "DEV-6": "names no guard id",
    "DEV-7": "cites no file.py:LINE",
    "DEV-8": "not the first thing after the heading",
    "DEV-9": "not of the form",
    "DEV-P2": "no **Reach:** line",
}


def test_the_checker_reports_every_planted_bad_entry_and_only_those() -> None:
    found = entries(PLANTED)
    assert [e.ident for e in found] == [*(f"DEV-{n}" for n in range(1, 11)), "DEV-12",
                                        "DEV-P1", "DEV-P2"]  # DEV-11 is fenced code
    by_ident = {e.ident: entry_problems(e) for e in found}
    for dev, expected in EXPECTED.items():
        assert any(expected in p for p in by_ident[dev]), (
            f"{dev}: expected {expected!r}, got {by_ident[dev]}")
    good = {dev: problems for dev, problems in by_ident.items()
            if dev not in EXPECTED and problems}
    assert not good, f"well-formed entries reported: {good}"
    listed = page_problems("planted.md", PLANTED)
    assert len(listed) == sum(len(p) for p in by_ident.values())
    assert all(line.startswith("planted.md: ") for line in listed)
    assert "planted.md: ## DEV-2 \u2014 missing: no **Reach:** line" in listed
