"""References between the docs and the code hold: every document the code names (a Markdown file
in a docstring or a comment) is in the repository, at the path named from the repository root;
every file the README and the docs pages name (``rollfeed/payload/read/_window.c``,
``tests/dist/test_train_resume.py``) is there; and every dotted ``rollfeed.`` name they quote
(``rollfeed.payload.read.compiled_read.COMPILED``) is a module or an attribute of one."""

import importlib
import re
import warnings
from pathlib import Path

import pytest

from tests.readme_blocks import doc_pages

REPO = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"[\w/-]+(?:\.[\w-]+)*\.md\b")
FILE = re.compile(r"\b(?:rollfeed|tests|docs)/[\w/.-]+\.[a-z]+\b")
DOTTED = re.compile(r"`(rollfeed(?:\.\w+)+)`")


def test_every_markdown_file_the_code_names_exists():
    missing = {}
    for path in sorted([*REPO.glob("rollfeed/**/*.py"), *REPO.glob("tests/**/*.py")]):
        absent = sorted(n for n in set(NAMED.findall(path.read_text())) if not (REPO / n).is_file())
        if absent:
            missing[str(path.relative_to(REPO))] = absent
    assert not missing, f"documents named but not in the repository: {missing}"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module or an attribute of one (a deprecated alias, as the
    changes page quotes them, resolves without its warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _lookup(dotted.split("."))


def _lookup(parts: list[str]) -> bool:
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", doc_pages())
def test_every_file_and_rollfeed_name_a_page_names_exists(page):
    text = (REPO / page).read_text()
    absent = sorted(n for n in set(FILE.findall(text)) if not (REPO / n).is_file())
    assert not absent, f"{page} names files that are not in the repository: {absent}"
    unknown = sorted(n for n in set(DOTTED.findall(text)) if not _resolves(n))
    assert not unknown, f"{page} names what rollfeed does not have: {unknown}"
