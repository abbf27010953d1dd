"""The fenced code blocks of the README and of every docs page, read from the Markdown as printed,
each with its page and heading.

A block's ``label`` names it in test ids and errors: ``<page>:L<line>-<heading>`` (the heading's
letters, digits and dots), the line being the block's first line of code in its page.
:func:`compiled` compiles a block with its page as the file name and its own line numbers, so a
traceback from a block points at the page's line.

Example: ``README.md`` holding ::

    ## Quick start
    ```python
    x = 1
    ```

gives ``[Block(page="README.md", line=3, heading="Quick start", lang="python",
code="x = 1\\n")]``, labelled ``"README.md:L3-Quick-start"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    line: int  # 1-based line in the page of the block's first line of code
    heading: str  # the nearest heading above it
    lang: str  # the fence's info string ("python", "bash", or "" for printed output)
    code: str
    page: str = "README.md"  # the page, from the repository root

    @property
    def label(self) -> str:
        return f"{self.page}:L{self.line}-" + re.sub(r"[^A-Za-z0-9.]+", "-", self.heading).strip(
            "-"
        )


def doc_pages() -> list[str]:
    """The README, then every page under ``docs/`` (sorted), as paths from the repository root."""
    docs = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md"))
    return ["README.md", *docs]


def page_blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` (a path from the repository root), in order."""
    return readme_blocks((REPO / page).read_text(), page=page)


def readme_blocks(text: str | None = None, *, page: str = "README.md") -> list[Block]:
    """Every fenced block of the README (or of ``text``, the text of ``page``), in order."""
    lines = (README.read_text() if text is None else text).splitlines(keepends=True)
    blocks, heading, i = [], "", 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            title = _HEADING.match(lines[i])
            heading = title.group(1) if title else heading
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"{page} line {i + 1}: a code fence that never closes")
        code = "".join(lines[i + 1 : end])
        blocks.append(Block(line=i + 2, heading=heading, lang=fence.group(1), code=code, page=page))
        i = end + 1
    return blocks


def compiled(block: Block, code: str | None = None) -> CodeType:
    """``block``'s code (or ``code``, a same-length variant of it) compiled so that its line
    numbers are its page's."""
    return compile(
        "\n" * (block.line - 1) + (block.code if code is None else code),
        str(REPO / block.page),
        "exec",
    )
