"""The docs site's sources: every page is in the navigation, the README stays short, and every plot draws.

``mkdocs build --strict`` (CI's docs stage) checks links, anchors, snippets and the generated reference; the code
blocks of the pages run in ``tests/test_readme.py``.
"""

import importlib.util
from pathlib import Path

import yaml

from tests.helpers.processes import REPO

ROOT = Path(REPO)
DOCS = ROOT / "docs"
MAX_README_LINES = 300


def _nav_pages(entries: list) -> list[str]:
    found = []
    for entry in entries:
        if isinstance(entry, str):
            found.append(entry)
        else:
            for value in entry.values():
                found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_every_page_is_in_the_navigation_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert len(set(nav)) == len(nav)


def test_the_readme_is_short_and_links_to_the_docs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    linked = {line.split("](docs/")[1].split(")")[0] for line in text.splitlines() if "](docs/" in line}
    assert {"getting-started.md", "how-to/several-gpus.md", "how-to/oom.md"} <= {link.split("#")[0] for link in linked}
    assert all((DOCS / link.split("#")[0]).is_file() for link in linked), linked


def test_every_plot_draws_from_the_benchmarks_data():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert set(hooks.PLOTS) == {"throughput", "fsdp_memory", "memory_timeline", "bucket_tuning"}
    for name, draw in hooks.PLOTS.items():
        png = draw()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, name
