"""The README stays short and the docs stay whole: every link between them resolves, every speed switch and every
command is documented, and the architecture page names every folder it describes."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from engine.cli.commands import COMMANDS
from engine.cli.flags import flag_name
from engine.cli.train import train_parser
from engine.config import SpeedConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""A Markdown link or image: ``[text](target)`` or ``![alt](target "title")``."""


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    """The text outside fenced code blocks and inline code, where a bracket is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"`[^`\n]*`", "", text)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(path: Path) -> list[str]:
    """Each relative link in ``path`` whose file, or heading within it, does not exist."""
    broken = []
    for target in LINK.findall(without_code(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.name}: {target} (no such file)")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{path.name}: {target} (no such heading)")
    return broken


def test_the_readme_reads_in_ten_minutes() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    assert len(markdown_files()) > 1
    assert [link for path in markdown_files() for link in broken_links(path)] == []


def linked_pages(path: Path) -> set[Path]:
    """The Markdown files ``path`` links to."""
    targets = (target.partition("#")[0] for target in LINK.findall(without_code(path.read_text(encoding="utf-8"))))
    return {(path.parent / t).resolve() for t in targets if t.endswith(".md") and not re.match(r"[a-z]+:", t)}


def test_every_doc_is_reached_from_the_readme() -> None:
    reached, todo = {README.resolve()}, [README.resolve()]
    while todo:
        for page in linked_pages(todo.pop()) - reached:
            if page.exists():
                reached.add(page)
                todo.append(page)
    assert [path.name for path in sorted(DOCS.glob("*.md")) if path.resolve() not in reached] == []


def test_every_speed_switch_is_documented() -> None:
    speed = (DOCS / "speed.md").read_text(encoding="utf-8")
    flags = [flag_name(spec) for spec in dataclasses.fields(SpeedConfig)] + ["--adamw", "--step-readout"]
    assert len(flags) > 5
    assert [flag for flag in flags if f"`{flag}" not in speed] == []


def switch_flags(text: str) -> set[str]:
    """The flags speed.md names as switches, in its headings and its table's rows (inline code that starts with
    the flag, as ```--fp8-base auto|off``` does; ```tunedeck bench --qlora``` is a command, not a switch)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    lines = [line for line in text.splitlines() if line.startswith(("### ", "| "))]
    return {match for line in lines for match in re.findall(r"`(--[a-z0-9-]+)", line)}


def test_every_switch_speed_md_names_is_a_flag_of_train() -> None:
    options = {option for action in train_parser()._actions for option in action.option_strings}
    named = switch_flags((DOCS / "speed.md").read_text(encoding="utf-8"))
    assert len(named) > 5
    assert sorted(named - options) == []


def test_every_command_is_documented() -> None:
    """The README shows the main commands; each of the others is at least in one of the docs."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in markdown_files())
    assert "tunedeck train" in README.read_text(encoding="utf-8")
    assert [name for name in COMMANDS if f"tunedeck {name}" not in text] == []


def test_the_architecture_page_names_every_folder_it_describes() -> None:
    text = (DOCS / "ARCHITECTURE.md").read_text(encoding="utf-8")
    engine = ROOT / "engine"
    components = [f"`{p.name}/`" for p in engine.iterdir() if (p / "__init__.py").exists()]
    components += [f"`{p.name}`" for p in engine.glob("*.py") if p.name != "__init__.py"]
    app = [f"`{p.name}/`" for p in (ROOT / "app").iterdir() if (p / "__init__.py").exists()]
    top = [f"`{name}/`" for name in ("engine", "app", "resources", "tests", "benchmarks", "packaging", "scripts")]
    assert [name for name in components + app + top if name not in text] == []


# --- the checkers themselves ---------------------------------------------------------------------------------


def test_a_broken_link_or_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Resident layers: `--resident-layers`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#resident-layers---resident-layers) [web](https://example.com/x.md)\n"
        "![gone](pictures/gone.png) [gone](other.md#no-such-heading) `[code](not-a-link.md)`\n"
        "```\n[fenced](nor-this.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: pictures/gone.png (no such file)",
        "page.md: other.md#no-such-heading (no such heading)",
    ]


def test_a_switch_flag_is_read_from_headings_and_table_rows_only() -> None:
    text = (
        "### fp8: `--fp8-base auto|off`\n| x | `--step-graphs` |\nprose `--not-a-switch`\n"
        "### Bench: `tunedeck bench --qlora`\n```\n### `--nor-this`\n```\n"
    )
    assert switch_flags(text) == {"--fp8-base", "--step-graphs"}
