"""docs/cli.md against the commands themselves: one section per `fadrm` subcommand, naming every
option its `--help` lists and no option the command lacks; and the README's table of commands,
one short line per command, each pointing at its section."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
# The options of every command, described once in the page's "Every command" section.
EVERY = {"-h", "--help", "--json", "--quiet"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
NAMED_COMMAND = re.compile(r"`fadrm ([a-z][a-z-]*)([^`]*)`")  # `fadrm export --with-teacher`


def command_options() -> dict[str, set[str]]:
    """Subcommand -> the options its `--help` lists: the `fadrm` console script's parser, with the
    subcommands the layers above register (tune, serve)."""
    from actors.cli import commands
    from fadrm_ray.cli import build_parser

    parser = build_parser(commands=commands())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for action in p._actions for o in action.option_strings} for name, p in sub.choices.items()}


def sections() -> dict[str, str]:
    """Heading -> text of each `## ` section of docs/cli.md."""
    parts = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]
    return {part.split("\n", 1)[0].strip(): part.split("\n", 1)[1] for part in parts}


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def named_flags(text: str, own: str | None) -> list[tuple[str, str]]:
    """(command, flag) of every option in `text`: those inside `fadrm COMMAND ...` are COMMAND's,
    the rest `own`'s (None: some command's)."""
    found = [(command, flag) for command, rest in NAMED_COMMAND.findall(text) for flag in FLAG.findall(rest)]
    return found + [(own, flag) for flag in FLAG.findall(NAMED_COMMAND.sub("", text))]


def test_every_command_has_a_section_that_names_each_of_its_options():
    options, pages = command_options(), sections()
    assert {"squeeze", "distill", "evaluate", "tune", "serve"} <= set(options)  # the layers above are in
    assert {f"fadrm {name}" for name in options} == {h for h in pages if h.startswith("fadrm ")}
    missing = {}
    for name, flags in options.items():
        named = {flag for command, flag in named_flags(pages[f"fadrm {name}"], name) if command == name}
        if flags - EVERY - named:
            missing[name] = sorted(flags - EVERY - named)
    assert missing == {}, f"options of --help that docs/cli.md does not name in the command's section: {missing}"
    assert all(EVERY <= flags for flags in options.values())
    assert {"--json", "--quiet"} <= set(FLAG.findall(pages["Every command"]))


def test_docs_name_no_option_a_command_lacks():
    options, pages = command_options(), sections()
    every = set().union(*options.values())
    wrong, checked = [], 0
    for heading, text in pages.items():
        own = heading.removeprefix("fadrm ") if heading.startswith("fadrm ") else None
        for command, flag in named_flags(text, own):
            checked += 1
            if flag not in (options.get(command, ()) if command else every):
                wrong.append(f"{heading}: {f'`fadrm {command}`' if command else 'no command'} has no {flag}")
    assert checked > 100 and wrong == [], "\n".join(wrong)


def test_the_readme_lists_each_command_in_one_line_pointing_at_its_section():
    readme = README.read_text()
    assert len(readme.splitlines()) <= 300, "the README is a newcomer's page: move detail to docs/"
    options, pages = command_options(), sections()
    table = readme.split("## The `fadrm` command", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| [`fadrm ")]
    listed = {}
    for row in rows:
        match = re.match(r"\| \[`fadrm ([a-z-]+)`\]\(docs/cli\.md#([a-z-]+)\) \| (.+) \|$", row)
        assert match, f"README row not of the form | [`fadrm NAME`](docs/cli.md#ANCHOR) | what it does |: {row}"
        name, target, what = match.groups()
        assert target == anchor(f"fadrm {name}") and f"fadrm {name}" in pages, row
        assert len(what) <= 100 and "|" not in what, f"one short line per command: {row}"
        listed[name] = what
    assert sorted(listed) == sorted(options) and len(rows) == len(options)
