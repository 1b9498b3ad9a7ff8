"""The docs a newcomer reads: every relative link in README.md, docs/ and benchmarks/README.md reaches a file, and
the heading it names where it names one.

`python tests/test_docs.py` prints each broken link.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# Written on other branches of issue 30 (security, GPU versions); drop an entry once its file lands.
PENDING = {"docs/security.md", "docs/gpu.md"}


def documents(root: Path) -> list[Path]:
    return [root / "README.md", root / "benchmarks" / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (outside code blocks), repeats suffixed -1, -2 as GitHub does."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text()), flags=re.M):
        base = anchor = slug(heading)
        n = 0
        while anchor in found:
            n += 1
            anchor = f"{base}-{n}"
        found.add(anchor)
    return found


def broken_links(root: Path = ROOT) -> list[str]:
    """'document: target (why)' for each relative link, outside code blocks, that reaches no file or heading."""
    broken = []
    for doc in documents(root):
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            where = f"{doc.relative_to(root).as_posix()}: {target}"
            if not path.exists():
                if not path.is_relative_to(root) or path.relative_to(root).as_posix() not in PENDING:
                    broken.append(f"{where} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{where} (no such heading)")
    return broken


def test_every_relative_link_resolves():
    assert broken_links() == []


def test_a_missing_file_or_heading_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "README.md").write_text("## bench_tp.py\n## bench_tp.py\n")
    (tmp_path / "docs" / "a.md").write_text("[up](../README.md#the-title) [pending](security.md)\n")
    (tmp_path / "README.md").write_text(
        "# The title\n[a](docs/missing.md) [b](benchmarks/README.md#bench_tppy-1) [c](benchmarks/README.md#nope)\n"
        "```\n[in a code block](nowhere.md)\n```\n[web](https://example.com)\n")
    assert broken_links(tmp_path) == ["README.md: docs/missing.md (no such file)",
                                      "README.md: benchmarks/README.md#nope (no such heading)"]


if __name__ == "__main__":
    print("\n".join(broken_links()) or "every link resolves")
