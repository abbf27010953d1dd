"""An mkdocs hook: the README is the site's home page, its links made the site's own.

The README links into ``docs/`` (``docs/payload.md``) and the pages link back to it
(``../README.md#quick-start``), as a repository browser reads them. On the site the README is
``index.md`` beside the pages, so ``docs/`` is dropped from the home page's links and a page's
``README.md`` link (``../`` per folder above it) becomes ``index.md``.

Example: on ``reference/payload.md``, ``[home](../../README.md#install)`` becomes
``[home](../index.md#install)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[2] / "README.md"
TO_README = re.compile(r"\]\(((?:\.\./)+)README\.md")


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    return files


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri == "index.md":
        return markdown.replace("](docs/", "](")
    return TO_README.sub(lambda m: "](" + m.group(1)[3:] + "index.md", markdown)
