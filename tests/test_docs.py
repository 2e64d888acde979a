"""The front door: the README stays short and every page of the manual is reachable from it; no
relative link in the README or docs/ points at a file that does not exist (files move; links rot)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "CHANGELOG.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                         if f.endswith(".md")]


def links(page):
    """Relative link targets of a Markdown page, anchors dropped."""
    text = open(os.path.join(ROOT, page)).read()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+://|#|mailto:", t) and t.split("#")[0]]


def test_the_readme_is_a_front_door():
    assert len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 250


def test_every_manual_page_is_linked_from_the_readme():
    linked = {os.path.normpath(t) for t in links("README.md")}
    assert [p for p in PAGES if p.startswith("docs") and p not in linked] == []


def test_relative_links_resolve():
    broken = [(page, t) for page in PAGES for t in links(page)
              if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), t))]
    assert broken == []


def test_each_manual_page_says_what_it_answers():
    """A title, then one paragraph (no heading, no table) before the first section."""
    for page in [p for p in PAGES if p.startswith("docs")]:
        head = open(os.path.join(ROOT, page)).read().split("\n\n")
        assert head[0].startswith("# ") and not head[1].startswith(("#", "|", "```")), page
