"""Print a strategy's option table, or bring the docs' option tables up to date, from the declarations.

    python docs/gen_options.py DDPStrategy        # the Markdown table of one strategy
    python docs/gen_options.py --readme           # rewrite the generated tables in README.md and docs/*.md
    python docs/gen_options.py --readme --check   # exit 1 if any of those tables is stale

A generated table in a Markdown file follows a line ``<!-- generated: options of CLASS -->`` (or
``<!-- generated: options of CLASS (name, name) -->`` for some options only) and ends at the first blank line. The
tables come from :func:`lightning_mgpu.core.options.markdown_table`.
"""

import argparse
import re
import sys
from pathlib import Path

import lightning_mgpu
from lightning_mgpu.core.options import markdown_table

DOCS = Path(__file__).resolve().parent
README = DOCS.parent / "README.md"


def pages() -> list[Path]:
    """The Markdown files that may hold generated tables: the README and every page of the docs."""
    return [README, *sorted(DOCS.rglob("*.md"))]


MARK = re.compile(r"^<!-- generated: options of (?P<strategy>\w+)(?: \((?P<names>[\w, ]+)\))? -->$")


def table(mark: re.Match) -> str:
    """The table a generated-table mark asks for."""
    strategy = getattr(lightning_mgpu, mark.group("strategy"))
    names = mark.group("names")
    return markdown_table(strategy, None if names is None else [name.strip() for name in names.split(",")])


def regenerate(text: str) -> str:
    """``text`` with every table that follows a generated-table mark replaced by the one generated now."""
    lines, out, at = text.splitlines(), [], 0
    while at < len(lines):
        line = lines[at]
        out.append(line)
        at += 1
        mark = MARK.match(line.strip())
        if mark is None:
            continue
        while at < len(lines) and lines[at].strip():  # the stale table, up to the blank line that ends it
            at += 1
        out += table(mark).splitlines()
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy", nargs="?", help="DDPStrategy, FSDPStrategy or MultiGPUStrategy")
    parser.add_argument(
        "--readme", action="store_true", help="rewrite the generated option tables of README.md and docs/"
    )
    parser.add_argument("--check", action="store_true", help="with --readme: only say whether they are up to date")
    args = parser.parse_args(argv)
    if not args.readme:
        if args.strategy is None:
            parser.error("name a strategy, or pass --readme")
        print(markdown_table(getattr(lightning_mgpu, args.strategy)))
        return 0
    stale = []
    for page in pages():
        text = page.read_text()
        fresh = regenerate(text)
        if fresh != text:
            stale.append(page)
            if not args.check:
                page.write_text(fresh)
    if args.check:
        for page in stale:
            print(f"{page.name}: option tables are stale; run python docs/gen_options.py --readme", file=sys.stderr)
        return int(bool(stale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
