"""The docs site builds with ``mkdocs build --strict`` (what ``make docs`` runs), offline: a
broken link or anchor, a page missing from the nav, a docstring reference that resolves to
nothing (docs/hooks/sphinx_roles.py) or a config warning fails the build, and the built pages
load nothing from another host."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A page's own resources: a script, a stylesheet, an image or a font fetched from another host.
REMOTE = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""")


def test_the_site_builds_strict_and_offline(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    pages = sorted(tmp_path.rglob("*.html"))
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "reference/payload/index.html").is_file()
    remote = {p.relative_to(tmp_path).as_posix() for p in pages if REMOTE.search(p.read_text())}
    assert not remote, f"pages that fetch from another host: {sorted(remote)}"
    home = (tmp_path / "index.html").read_text()
    assert 'href="payload/"' in home  # the README's docs/ links, made the site's
