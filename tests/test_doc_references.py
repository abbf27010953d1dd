"""Every document the code names (a Markdown file in a docstring or a comment) is in the
repository, at the path named from the repository root."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"[\w/-]+(?:\.[\w-]+)*\.md\b")


def test_every_markdown_file_the_code_names_exists():
    missing = {}
    for path in sorted([*REPO.glob("rollfeed/**/*.py"), *REPO.glob("tests/**/*.py")]):
        absent = sorted(n for n in set(NAMED.findall(path.read_text())) if not (REPO / n).is_file())
        if absent:
            missing[str(path.relative_to(REPO))] = absent
    assert not missing, f"documents named but not in the repository: {missing}"
