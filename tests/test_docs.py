"""The docs say what the code does: the flags tables are the settings' own, every variable and
flag the docs name exists, every link leads somewhere, and the README stays a page."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from engine.settings import env_name, flag_name
from tools import flags_doc

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VARIABLE = re.compile(r"CROWDCHAT_[A-Z][A-Z0-9_]*[A-Z0-9]")
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 260  # issue 33: "at most ~250 lines"; the rest lives in docs/


def settings_flags() -> dict[str, str]:
    """Flag -> environment variable of every setting that has a flag."""
    return {
        flag_name(f): env_name(f)
        for cls in flags_doc.CONFIGS
        for f in fields(cls)
        if f.metadata.get("cli")
    }


def code_files() -> list[Path]:
    """crowdchat's own code, scripts and Makefile (not the docs, not this file, no venv)."""
    out = [ROOT / "Makefile", *ROOT.glob("*.py")]
    for top in ROOT.iterdir():
        if top.is_dir() and not top.name.startswith(".") and top.name not in ("data", "docs"):
            out += [*top.rglob("*.py"), *top.rglob("*.sh")]
    return [p for p in out if p.resolve() != Path(__file__).resolve()]


def code_blocks(text: str) -> list[str]:
    """The text inside each fenced code block of a Markdown text."""
    return re.split(r"^```.*$", text, flags=re.M)[1::2]


def test_the_flags_tables_are_what_the_settings_render() -> None:
    doc = flags_doc.DOC.read_text(encoding="utf-8")
    assert flags_doc.spliced(doc) == doc, "docs/OPERATIONS.md: run python -m tools.flags_doc"
    rows = [line for line in flags_doc.generated_part(doc).splitlines() if line.startswith("| `-")]
    assert len(rows) == len(settings_flags())


def test_the_generator_rewrites_a_stale_table_and_then_finds_it_current(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    current = flags_doc.DOC.read_text(encoding="utf-8")
    stale = tmp_path / "OPERATIONS.md"
    stale.write_text(current.replace("| `--port` |", "| `--porte` |"), encoding="utf-8")
    monkeypatch.setattr(flags_doc, "DOC", stale)
    assert flags_doc.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert flags_doc.main([]) == 0
    assert stale.read_text(encoding="utf-8") == current
    assert flags_doc.main(["--check"]) == 0


def test_every_crowdchat_variable_the_docs_name_is_one_the_code_reads() -> None:
    known = set(settings_flags().values())
    for path in code_files():
        known |= set(VARIABLE.findall(path.read_text(encoding="utf-8", errors="replace")))
    for doc in DOCS:
        unknown = set(VARIABLE.findall(doc.read_text(encoding="utf-8"))) - known
        assert not unknown, f"{doc.name} names variables no code reads: {sorted(unknown)}"


def test_every_server_flag_in_the_readme_is_real_and_has_its_variable() -> None:
    ours = settings_flags()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.startswith("| `--"):  # the table of the flags people change
            flags, envs = line.split("|")[1:3]
            pairs = zip(re.findall(r"--[a-z-]+", flags), VARIABLE.findall(envs), strict=True)
            for flag, env in pairs:
                assert ours.get(flag) == env, f"README's row for {flag}: {env}"
    for block in code_blocks(text):
        for line in block.splitlines():
            if "app.py" in line or "make run" in line:
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                    assert flag in ours or flag == "--help", f"README runs {flag}: {line}"


def anchors(markdown: Path) -> set[str]:
    """The #anchors GitHub gives the headings of a Markdown file."""
    headings = re.findall(r"^#+ (.+)$", markdown.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_docs_leads_to_a_file_and_heading() -> None:
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            path = (doc.parent / name).resolve() if name else doc
            assert path.exists(), f"{doc.name} links to {target}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path), f"{doc.name} links to {target}: no such heading"


def test_the_readme_stays_a_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/"
