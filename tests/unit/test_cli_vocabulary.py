"""One CLI vocabulary (issue 43): every `node` command that talks to a swarm takes the same flags for
the same concepts, defined once in node/cli/flags.py, and refuses a bad swarm key in one line."""

from __future__ import annotations

import argparse
import logging

import pytest

import node.cli as cli
from node.p2p.swarm_key import ENV_VAR, generate_swarm_key
from node.server import daemon

PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
SWARM_FACING = {"bootstrap", "join", "doctor", "status", "dashboard", "export"}
SWARM_FLAGS = ("--initial-peers", "--swarm", "--swarm-id", "--swarm-key", "--swarm-founder")
SHARED_FLAGS = (*SWARM_FLAGS, "--identity", "--json")
FOUNDER_ITSELF = {"bootstrap"}  # it signs the config: there is no other founder to name
KEY_WRITERS = {"keygen"}  # --swarm-key names the file it writes, not one to read


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def meaning(action: argparse.Action) -> dict[str, object]:
    """What a flag means to a user; `required` is left out (bootstrap may start without peers)."""
    return {
        "option_strings": sorted(action.option_strings),
        "dest": action.dest,
        "metavar": action.metavar,
        "help": action.help,
        "default": action.default,
        "nargs": action.nargs,
        "type": action.type,
        "kind": type(action).__name__,
    }


@pytest.fixture(scope="module")
def commands() -> dict[str, dict[str, argparse.Action]]:
    return {name: options(sub) for name, sub in subcommands(cli.build_parser()).items()}


def test_the_swarm_facing_commands_are_the_ones_that_take_initial_peers(commands):
    assert {name for name, flags in commands.items() if "--initial-peers" in flags} == SWARM_FACING


@pytest.mark.parametrize("flag", SWARM_FLAGS)
def test_every_swarm_facing_command_takes_the_swarm_flags(commands, flag):
    expected = SWARM_FACING - FOUNDER_ITSELF if flag == "--swarm-founder" else SWARM_FACING
    assert {name for name in SWARM_FACING if flag in commands[name]} == expected


@pytest.mark.parametrize("flag", SHARED_FLAGS)
def test_a_shared_flag_means_the_same_in_every_command_that_takes_it(commands, flag):
    meanings = {
        name: meaning(flags[flag]) for name, flags in commands.items() if flag in flags and name not in KEY_WRITERS
    }
    assert meanings, f"no command takes {flag}"
    first = next(iter(meanings.values()))
    assert {name: m for name, m in meanings.items() if m != first} == {}, f"{flag} differs from {first}"


def test_a_key_writer_stores_the_swarm_key_where_the_readers_do(commands):
    reader = commands["join"]["--swarm-key"]
    for name in KEY_WRITERS:
        writer = commands[name]["--swarm-key"]
        assert (writer.dest, writer.metavar) == (reader.dest, reader.metavar), name


def test_status_and_dashboard_parse_a_swarm_key():
    parser = cli.build_parser()
    for command in ("status", "dashboard"):
        args = parser.parse_args([command, "--initial-peers", PEER, "--swarm-key", "swarm.key"])
        assert args.swarm_key_path == "swarm.key"


@pytest.fixture
def no_node_starts(monkeypatch):
    """main() without logging set-up, and any attempt to run a node fails the test."""

    def refuse(coroutine):
        coroutine.close()
        raise AssertionError("a node was started before the swarm key was checked")

    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    monkeypatch.setattr(daemon, "run", refuse)
    monkeypatch.delenv(ENV_VAR, raising=False)


def swarm_argv(command: str) -> list[str]:
    peers = [] if command == "bootstrap" else ["--initial-peers", PEER]
    return [command, *peers, *(["--out", "unused"] if command == "export" else [])]


@pytest.mark.parametrize("command", sorted(SWARM_FACING))
@pytest.mark.parametrize("from_env", [False, True], ids=["flag", "env"])
def test_a_missing_swarm_key_is_refused_in_one_line(command, from_env, tmp_path, monkeypatch, caplog, no_node_starts):
    if command == "export":
        pytest.importorskip("transformers")  # export refuses earlier without it
    missing = tmp_path / "no-such.key"
    argv = swarm_argv(command)
    if from_env:
        monkeypatch.setenv(ENV_VAR, str(missing))
    else:
        argv += ["--swarm-key", str(missing)]
    with caplog.at_level(logging.ERROR, logger="node"):
        assert cli.main(argv) == 2
    message = caplog.records[-1].getMessage()
    assert message.startswith("refusing to start: cannot read the swarm key") and str(missing) in message
    assert "\n" not in message


def keys_of_started_networks(monkeypatch) -> list[bytes | None]:
    """The swarm key each network the observer starts is given (the start is refused right there)."""
    import node.monitor.observer as observer

    networks: list[bytes | None] = []

    async def fake_start_network(**kwargs):
        networks.append(kwargs["swarm_key"])
        raise daemon.JoinRefused("stop before any network starts")

    monkeypatch.setattr(observer, "start_network", fake_start_network)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    return networks


@pytest.mark.parametrize("command", ["status", "dashboard"])
@pytest.mark.parametrize("from_env", [False, True], ids=["flag", "env"])
def test_status_and_dashboard_observe_with_the_swarm_key(command, from_env, tmp_path, monkeypatch):
    key_path = tmp_path / "swarm.key"
    key = generate_swarm_key(key_path)
    networks = keys_of_started_networks(monkeypatch)
    argv = [command, "--initial-peers", PEER, *(["--once"] if command == "dashboard" else [])]
    if from_env:
        monkeypatch.setenv(ENV_VAR, str(key_path))
    else:
        monkeypatch.delenv(ENV_VAR, raising=False)
        argv += ["--swarm-key", str(key_path)]
    assert cli.main(argv) == 3
    assert networks == [key]


def test_status_without_a_key_observes_an_open_swarm(monkeypatch):
    networks = keys_of_started_networks(monkeypatch)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert cli.main(["status", "--initial-peers", PEER]) == 3
    assert networks == [None]
