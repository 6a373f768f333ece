"""The README and the pages under docs/: the README stays short enough to read in one sitting,
every relative Markdown link (and image) in README.md and docs/*.md points at a file that exists,
and every docs/*.md page is linked from the README. Plain file reading: no import of the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 350

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
# [text](target) and ![alt](target), with an optional "title" after the target
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
# [label]: target
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def link_targets(text: str) -> list[str]:
    """Every link target in Markdown text, outside fenced code blocks and code spans (a code span
    inside a link's text, as in [`tests/x.py`](../tests/x.py), leaves the link itself in place)."""
    text = _FENCE.sub("", text)
    text = _CODE_SPAN.sub("code", text)
    return _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)


def local_links(md: Path) -> list[tuple[str, Path]]:
    """(target as written, the path it resolves to) for each relative file link in ``md``;
    http(s) and other scheme links and pure #anchors are left out, a #anchor is stripped."""
    out = []
    for target in link_targets(md.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        out.append((target, (md.parent / path).resolve()))
    return out


def broken_links(root: Path) -> list[str]:
    return [
        f"{md.relative_to(root)}: ({target}) -> no such file"
        for md in doc_files(root)
        if md.is_file()
        for target, path in local_links(md)
        if not path.exists()
    ]


def unlinked_pages(root: Path) -> list[str]:
    linked = {path for _, path in local_links(root / "README.md")}
    return [
        str(page.relative_to(root))
        for page in sorted((root / "docs").glob("*.md"))
        if page.resolve() not in linked
    ]


def readme_lines(root: Path) -> int:
    return len((root / "README.md").read_text(encoding="utf-8").splitlines())


def test_readme_reads_in_one_sitting():
    n = readme_lines(ROOT)
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_relative_links_resolve():
    assert broken_links(ROOT) == []


def test_every_docs_page_is_linked_from_the_readme():
    assert (ROOT / "docs").is_dir()
    assert unlinked_pages(ROOT) == []


def test_the_checks_catch_a_long_readme_a_broken_link_and_an_unlinked_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    body = [
        "# x",
        "[a page](docs/a.md#part) [a test](tests/test_x.py) [web](https://example.com) [here](#x)",
        "[gone](docs/gone.md)",
        "`[in code](nowhere.md)`",
        "```",
        "[in a fence](nowhere.md)",
        "```",
    ]
    (tmp_path / "README.md").write_text("\n".join(body + ["."] * (351 - len(body))) + "\n")
    (tmp_path / "docs" / "a.md").write_text("[back](../README.md) ![img](img/missing.png)\n")
    (tmp_path / "docs" / "orphan.md").write_text("[ok](a.md)\n")

    assert readme_lines(tmp_path) == 351
    assert broken_links(tmp_path) == [
        "README.md: (docs/gone.md) -> no such file",
        "docs/a.md: (img/missing.png) -> no such file",
    ]
    assert unlinked_pages(tmp_path) == ["docs/orphan.md"]


def _preset_rows(text: str) -> dict[str, list[str]]:
    """The rows of the markdown table headed ``| preset | ...``: name → its other cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| preset |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        m = re.match(r"\| `(\w+)`( \(default\))? \|(.*)\|\s*$", line)
        rows[m.group(1)] = [c.strip() for c in m.group(3).split("|")]
    return rows


def test_the_preset_tables_say_what_the_config_says():
    """The presets are declared once (``grpo_fast.presets.PRESETS``, each with its summary "for:
    what it sets"); the README's table and docs/training.md's say the same, preset for preset."""
    from grpo_fast.config import PRESETS

    readme = _preset_rows((ROOT / "README.md").read_text())
    training = _preset_rows((ROOT / "docs" / "training.md").read_text())
    assert list(readme) == list(PRESETS) == list(training)
    for name, preset in PRESETS.items():
        who, what = preset.summary.split(": ", 1)
        assert readme[name] == [preset.summary], name
        assert training[name] == [who, what], name
