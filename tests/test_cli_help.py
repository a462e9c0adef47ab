"""Every command's help is complete: each option says what it does, and a
flag shows no value placeholder (``--rigid``, not ``--rigid <bool>``)."""

from __future__ import annotations

import typer

from tidal.cli.main import app


def _commands():
    root = typer.main.get_command(app)
    yield "tidal", root
    for name, cmd in root.commands.items():  # typer's own click: duck-typed
        yield f"tidal {name}", cmd


def test_every_option_has_a_description_and_flags_no_placeholder():
    missing, placeholders = [], []
    for where, cmd in _commands():
        for p in cmd.params:
            if type(p).__name__ != "TyperOption" or p.name == "help":
                continue
            if not (p.help or "").strip():
                missing.append(f"{where} {p.opts[0]}")
            if p.is_flag and p.metavar != "":
                placeholders.append(f"{where} {p.opts[0]}")
        assert (cmd.help or "").strip(), f"{where} has no description"
    assert missing == [], f"options without a description: {missing}"
    assert placeholders == [], f"flags that show a value placeholder: {placeholders}"
