"""README.md's commands are the ones `node --help` has: every `pipeswarm CMD --flag` / `node CMD
--flag` it shows runs, every command is shown, and every flag in "Running a real swarm" exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from node.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
INVOCATION = re.compile(r"^\s*(?:pipeswarm|node) ([a-z][a-z-]*)(.*)$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SECTION = "## Running a real swarm"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def readme_pieces(text: str) -> list[tuple[str, bool]]:
    """(piece, in a code block): each fenced line, and each inline `code` span outside fences."""
    pieces, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            pieces.append((line, True))
        else:
            pieces += [(span, False) for span in re.findall(r"`([^`]+)`", line)]
    return pieces


def invocations(text: str) -> list[tuple[str, str, list[str]]]:
    """(command, the invocation, its --flags) for every `pipeswarm CMD ...` / `node CMD ...` shown."""
    found = []
    for piece, _ in readme_pieces(text):
        if match := INVOCATION.match(piece):
            found.append((match.group(1), piece.strip(), FLAG.findall(match.group(2))))
    return found


def section(text: str, heading: str) -> str:
    """From `heading` to the next heading of any level (a `# comment` in a code block is none)."""
    lines, fenced, inside = [], False, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            if inside:
                break
            inside = line.strip() == heading
        if inside:
            lines.append(line)
    return "\n".join(lines)


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


def test_the_readme_shows_commands(readme):
    assert len(invocations(readme)) >= 10, "the parsing of README.md's commands found almost none"


def test_every_command_the_readme_shows_exists_with_its_flags(readme):
    commands = subcommands()
    for command, shown, flags in invocations(readme):
        assert command in commands, f"README.md shows `{shown}`: `node` has no command {command}"
        known = {flag for action in commands[command]._actions for flag in action.option_strings}
        assert [flag for flag in flags if flag not in known] == [], f"README.md shows `{shown}`"


def test_the_readme_shows_every_command(readme):
    shown = {command for command, _, _ in invocations(readme)}
    assert set(subcommands()) - shown == set(), "commands README.md never shows"


def test_every_flag_in_running_a_real_swarm_exists(readme):
    text = section(readme, SECTION)
    assert text, f"README.md has no {SECTION!r}"
    known = {flag for sub in subcommands().values() for action in sub._actions for flag in action.option_strings}
    assert sorted(set(FLAG.findall(text)) - known) == [], f"flags in README.md's {SECTION!r} that no command has"


def test_the_readme_names_the_commands_that_take_a_swarm_key(readme):
    listed = re.search(r"Every command that takes `--initial-peers` \(([a-z, -]+)\)\s+takes `--swarm-key", readme)
    assert listed, "README.md no longer says which commands take --swarm-key"
    named = {name.strip() for name in listed.group(1).replace(" and ", ", ").split(",")}
    commands = subcommands()
    swarm_facing = {name for name, sub in commands.items() if "initial_peers" in {a.dest for a in sub._actions}}
    assert named == swarm_facing
    assert all("swarm_key_path" in {a.dest for a in commands[name]._actions} for name in named)
