"""DS3_* environment variables that name no setting: a misspelt one (DS3_MAX_LIVE_PER_CLIENTS)
would otherwise be ignored without a word, and the server would run with the default the user
meant to change. Every option of every command declares its variable (click's `envvar`), so
the known names are read off the command tree; the rest of the DS3_ namespace is internal
plumbing (a reader's workers, tests' fault injection)."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping

import click

# Set by ds3 itself for its own processes (a reader's workers), or by tests (fault injection,
# tests/test_crash.py's knobs).
INTERNAL_PREFIXES = ("DS3_READER_", "DS3_TEST_", "DS3_CRASH_")
# A switch for A/B measurements (docs/bench.md), and the scripts' and tests' own knobs.
INTERNAL = frozenset({"DS3_DEV_PARENT", "DS3_FAST_LANE", "DS3_STANDBY_FOLLOW", "DS3_VENV", "DS3_PYTHON", "DS3_ROOT", "DS3_FORCE_INSTALL", "DS3_FUZZ_SCALE",
                      "DS3_INTEROP_BASE_URL", "DS3_UPDATE_SCREENSHOTS"})


def known_settings(command: click.Command) -> set[str]:
    """The environment variables of every option of `command` and its subcommands."""
    names: set[str] = set()
    for cmd in _walk(command):
        for param in cmd.params:
            env = getattr(param, "envvar", None)
            if isinstance(env, str):
                names.add(env)
            elif env:
                names.update(env)
    return names


def _walk(command: click.Command) -> Iterator[click.Command]:
    yield command
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            yield from _walk(sub)


def unknown_settings(environ: Mapping[str, str], known: set[str]) -> dict[str, str]:
    """Each DS3_* variable in `environ` that is no setting, and what to say about it (with the
    nearest setting's name)."""
    out = {}
    for name in sorted(environ):
        if not name.startswith("DS3_") or name in known or name in INTERNAL or name.startswith(INTERNAL_PREFIXES):
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        out[name] = f"{name} is not a ds3 setting: it is ignored" + (f" (did you mean {near[0]}?)" if near else "")
    return out
