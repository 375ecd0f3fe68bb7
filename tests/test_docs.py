"""The documentation says what the code does: every page README and the docs point to is
there, and every option docs/commands.md shows in a command's synopsis is one that command
takes (and every option a command takes is shown)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli.main import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _named_pages(text: str) -> set[str]:
    """The docs/*.md pages a text names (in backticks or a link)."""
    return set(re.findall(r"docs/[A-Za-z0-9_]+\.md", text)) | {
        "docs/" + name for name in re.findall(r"\]\(([A-Za-z0-9_]+\.md)(?:#[^)]*)?\)", text)}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_page_a_page_names_is_there(page):
    missing = sorted(name for name in _named_pages(page.read_text()) if not (ROOT / name).is_file())
    assert not missing, f"{page.name} names {missing}"


def _synopses() -> dict[str, set[str]]:
    """Each command's options as docs/commands.md's synopsis blocks show them."""
    found: dict[str, set[str]] = {}
    text = (ROOT / "docs" / "commands.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.split()
            if "meshplan" not in words:
                continue
            name = words[words.index("meshplan") + 1]
            found.setdefault(name, set()).update(re.findall(r"(?<![\w-])(--?[a-zA-Z][a-z0-9-]*)", line))
    return found


def test_every_command_is_shown_with_the_options_it_takes():
    shown = _synopses()
    assert set(shown) == set(main.commands), "docs/commands.md shows other commands than the CLI has"
    for name, command in main.commands.items():
        params = [p for p in command.params if p.opts and p.opts[0].startswith("-") and "--help" not in p.opts]
        taken = {o for p in params for o in list(p.opts) + list(p.secondary_opts)}
        wrong = {o for o in shown[name] if o.startswith("--")} - taken
        assert not wrong, f"docs/commands.md shows {sorted(wrong)} for meshplan {name}, which it does not take"
        unshown = [p.opts[-1] for p in params if not (set(p.opts) | set(p.secondary_opts)) & shown[name]]
        assert not unshown, f"meshplan {name} takes {sorted(unshown)}, which docs/commands.md does not show"
