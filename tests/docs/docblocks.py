"""The commands in README.md and docs/*.md, as the docs-examples tests see them.

A fenced ``bash`` block is preceded by a marker saying how it is tested::

    <!-- docs-test: run -->          each line runs, in a scratch directory outside the checkout
    <!-- docs-test: run slow -->     the same, in the slow set (-m slow)
    <!-- docs-test: cluster -->      the first line is `tidal up ...`; the others run against it
    <!-- docs-test: hosts -->        lines run on the hosts their comments name (`# host A (10.0.0.1)`,
                                     `# every GPU host`, `# anywhere ...`), network namespaces
                                     at those addresses (tests/multihost/test_docs_hosts.py)
    <!-- docs-test: ci -->           .ci/run runs these very commands

Inline code spans that start with ``tidal `` or ``python ...`` are checked
too: the command, its options and the files it names exist.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->")
INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:tidal|python3?|pip) [^`]+)`")


@dataclass(frozen=True)
class Block:
    """A fenced shell block: where it is, how it is tested, its command lines."""

    file: Path
    line: int
    kind: str
    arg: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[tuple[str, str]]:
        """(command, the comment before it) per non-blank line; a line's own
        trailing comment is dropped, a comment line is kept as context."""
        out, context, comment_run = [], "", False
        for raw in self.text.replace("\\\n", " ").splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                context = line if not comment_run else context  # a run of comment lines: its first
                comment_run = True
                continue
            comment_run = False
            out.append((strip_comment(line), context))
        return out


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# ...`` (outside quotes)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        toks = list(lex)
    except ValueError:
        return line
    cut = line.find(" #")
    return line[:cut].rstrip() if toks and cut > 0 else line


def blocks() -> list[Block]:
    """Every fenced bash/sh block of the docs, with its marker ("" if none)."""
    out = []
    for f in DOCS:
        lines = f.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(bash|sh|console)\s*$", lines[i])
            if not m:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            mark = MARK.search(lines[i - 1]) if i > 0 else None
            out.append(Block(f, i + 1, mark.group(1) if mark else "", mark.group(2) if mark else "",
                             "\n".join(lines[i + 1:j])))
            i = j + 1
    return out


def inline_commands() -> list[tuple[str, str]]:
    """(where, command) for every inline code span that is a command."""
    out = []
    for f in DOCS:
        fence = False
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if line.startswith("```"):
                fence = not fence
                continue
            if not fence:
                out += [(f"{f.relative_to(REPO)}:{n}", m.group(1)) for m in INLINE.finditer(line)]
    return out


def split_commands(line: str) -> list[str]:
    """``a; b && c`` -> the simple commands in it (pipes keep their first part)."""
    parts = re.split(r"\s*(?:;|&&|\|\|)\s*", line)
    return [p.split(" | ")[0].strip() for p in parts if p.strip()]
