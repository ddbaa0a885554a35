"""The docs point at things that exist: every relative link in a Markdown file, and every
`docs/<page>.md` a source file or doc names, resolves to a file in this tree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOC_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / p for p in out.stdout.split() if (REPO / p).is_file() and not p.startswith("bench/results/")]


def test_relative_links_in_markdown_resolve():
    broken = []
    for page in tracked("*.md"):
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_named_doc_pages_exist():
    missing = []
    for path in tracked("*.md", "*.py", "*.toml", "*.sh"):
        if path == Path(__file__).resolve():  # its own examples of broken names
            continue
        for page in DOC_MENTION.findall(path.read_text(errors="replace")):
            if not (REPO / page).is_file():
                missing.append(f"{path.relative_to(REPO)} names {page}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_checks_see_a_broken_link(tmp_path):
    assert LINK.findall("see [the spec](docs/nope.md#limits) and [x](https://e.org)") == [
        "docs/nope.md",
        "https://e.org",
    ]
    assert DOC_MENTION.findall("(see docs/operations.md), not mydocs/x.md") == ["docs/operations.md"]
