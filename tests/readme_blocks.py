"""The fenced code blocks of README.md, read from the Markdown as printed, each with its heading.

A block's ``label`` names it in test ids and errors: ``L<line>-<heading>`` (the heading's
letters, digits and dots), the line being the block's first line of code in README.md.
:func:`compiled` compiles a block with README.md as its file name and its own line numbers, so a
traceback from a block points at the README's line.

Example: a README holding ::

    ## Quick start
    ```python
    x = 1
    ```

gives ``[Block(line=3, heading="Quick start", lang="python", code="x = 1\\n")]``, labelled
``"L3-Quick-start"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    line: int  # 1-based line in README.md of the block's first line of code
    heading: str  # the nearest heading above it
    lang: str  # the fence's info string ("python", or "" for printed output)
    code: str

    @property
    def label(self) -> str:
        return f"L{self.line}-" + re.sub(r"[^A-Za-z0-9.]+", "-", self.heading).strip("-")


def readme_blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README (or of ``text``), in order."""
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
            raise ValueError(f"README.md line {i + 1}: a code fence that never closes")
        code = "".join(lines[i + 1 : end])
        blocks.append(Block(line=i + 2, heading=heading, lang=fence.group(1), code=code))
        i = end + 1
    return blocks


def compiled(block: Block, code: str | None = None) -> CodeType:
    """``block``'s code (or ``code``, a same-length variant of it) compiled so that its line
    numbers are README.md's."""
    return compile(
        "\n" * (block.line - 1) + (block.code if code is None else code), str(README), "exec"
    )
