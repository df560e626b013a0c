"""Links into the docs resolve: every `decisions.md#<anchor>` (and `docs/decisions.md, <anchor>`) that a tracked
text file cites names a heading of docs/decisions.md, every `(#anchor)` inside docs/*.md names a heading of its own
file, and every `<doc>.md#anchor` to another docs/*.md file names a heading there.

An entry of docs/decisions.md is a `### <name>` heading and its anchor is <name> as written; any heading also
answers to its GitHub anchor (lowercase, punctuation dropped, spaces as '-'), as `## Routing policy` does to
`routing-policy`. CPU only: reads the files `git ls-files` lists (the tree itself where git has none)."""

import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DECISIONS = DOCS / "decisions.md"

SUFFIXES = {".py", ".md", ".json", ".yaml", ".yml", ".smk", ".j2", ".jinja"}
NAMES = {"Snakefile"}
SKIPPED_DIRS = {".git", ".snakemake", "results", "__pycache__", "node_modules"}

HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# `<path>.md#anchor`: the anchor ends at the first character that cannot be part of one (a closing parenthesis,
# a backtick, a full stop ending the sentence).
DOC_ANCHOR = re.compile(r"(?<![\w-])([\w-]+)\.md#([\w-]+)")
# `docs/decisions.md, <entry>`, the form comments use where a URL fragment would read oddly. An entry name always
# has a hyphen, which keeps ordinary prose after the comma out.
DECISIONS_COMMA = re.compile(r"decisions\.md, ([a-z0-9]+(?:-[a-z0-9]+)+)")
LOCAL_ANCHOR = re.compile(r"\]\(#([^)\s]+)\)")


def github_anchor(text: str) -> str:
    """The fragment GitHub gives a heading: lowercase, punctuation other than '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set:
    """Every fragment that resolves in a Markdown text: each heading's GitHub anchor (repeats numbered -1, -2, ...
    as GitHub numbers them) and, for `###` headings, the heading text as written."""
    found, seen = set(), {}
    for level, title in HEADING.findall(markdown):
        slug = github_anchor(title)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
        if level == "###":
            found.add(title)
    return found


def tracked_files() -> list:
    """The text files the check reads, as paths relative to the repository root."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
        paths = [Path(line) for line in listed.stdout.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        paths = [p.relative_to(ROOT) for p in ROOT.rglob("*")
                 if p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts)]
    this = Path(__file__).resolve().relative_to(ROOT)  # its own made-up references are examples
    return sorted(p for p in paths
                  if (p.suffix in SUFFIXES or p.name in NAMES) and (ROOT / p).is_file() and p != this)


def references(relative: Path, text: str, docs: dict):
    """(line, target doc name, anchor) for each reference in `text` to a heading of a docs/*.md file."""
    local = relative.parent == Path("docs") and relative.suffix == ".md"
    if ".md" not in text and not local:
        return
    found = [(m.start(), f"{m.group(1)}.md", m.group(2)) for m in DOC_ANCHOR.finditer(text)
             if f"{m.group(1)}.md" in docs]
    found += [(m.start(), DECISIONS.name, m.group(1)) for m in DECISIONS_COMMA.finditer(text)]
    if local:
        found += [(m.start(), relative.name, m.group(1)) for m in LOCAL_ANCHOR.finditer(text)]
    for start, doc, anchor in sorted(found):
        yield text.count("\n", 0, start) + 1, doc, anchor


def dangling(files: dict, docs: dict) -> list:
    """'path:line: doc#anchor' for each reference whose anchor is not a heading of its doc. `files` maps a
    relative path to its text, `docs` a docs/*.md file name to its set of anchors."""
    bad = []
    for relative, text in files.items():
        for number, doc, anchor in references(relative, text, docs):
            if anchor not in docs[doc]:
                bad.append(f"{relative}:{number}: {doc}#{anchor}")
    return bad


@functools.lru_cache(maxsize=1)
def _read_tree():
    docs = {p.name: anchors(p.read_text(encoding="utf-8")) for p in sorted(DOCS.glob("*.md"))}
    files = {}
    for relative in tracked_files():
        try:
            files[relative] = (ROOT / relative).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return files, docs


def test_every_docs_anchor_resolves():
    files, docs = _read_tree()
    assert DECISIONS.name in docs
    bad = dangling(files, docs)
    assert not bad, "anchors without a heading:\n" + "\n".join(bad)


def test_the_references_are_found():
    """The check reads the references that exist (or the test above would pass on a regex that matches nothing):
    source, docs and config all cite decisions.md entries, and decisions.md links its own entries."""
    files, docs = _read_tree()
    found = [(relative, doc) for relative, text in files.items() for _, doc, _ in references(relative, text, docs)]
    cited_from = {relative.parts[0] for relative, doc in found if doc == DECISIONS.name}
    assert {"docs", "kernels", "model", "workflow", "config"} <= cited_from
    assert sum(1 for relative, _ in found if relative == Path("docs/decisions.md")) >= 20
    assert "hopper-tail" in docs[DECISIONS.name] and "routing-policy" in docs[DECISIONS.name]


def test_a_dangling_anchor_is_reported():
    docs = {"decisions.md": anchors("# Title\n\n## Routing policy\n\n### hopper-tail\ntext\n")}
    files = {
        Path("kernels/x.py"): "# docs/decisions.md#hopper-tail, docs/decisions.md#routing-policy.\n"
                              "# docs/decisions.md#hopper-tale\n",
        Path("model/y.py"): '"""(docs/decisions.md, hopper-tail) (docs/decisions.md, no-such-entry)"""\n',
        Path("docs/decisions.md"): "see [t](#hopper-tail) and [u](#gone)\n",
    }
    assert dangling(files, docs) == [
        "kernels/x.py:2: decisions.md#hopper-tale",
        "model/y.py:1: decisions.md#no-such-entry",
        "docs/decisions.md:1: decisions.md#gone",
    ]
