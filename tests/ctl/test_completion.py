"""`fusionctl completion bash|zsh|fish`: scripts generated from the parser, checked in the
shells themselves (bash always; zsh and fish where installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fusionctl.cli import build_parser, run

Capture = pytest.CaptureFixture[str]


def _script(shell: str, capsys: Capture) -> str:
    assert run(["completion", shell]) == 0
    return capsys.readouterr().out


def _complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of `words` (the word being typed)."""
    arr = " ".join(f"'{w}'" for w in ("fusionctl", *words))
    out = subprocess.run(
        ["bash", "-c", f"source {script}; COMP_WORDS=({arr}); COMP_CWORD={len(words)}; "
         "_fusionctl; printf '%s\\n' \"${COMPREPLY[@]}\""],
        capture_output=True, text=True, check=True, timeout=10)
    return [w for w in out.stdout.splitlines() if w]


def test_bash_completes_commands_subcommands_and_options(tmp_path: Path,
                                                         capsys: Capture) -> None:
    script = tmp_path / "fusionctl.bash"
    script.write_text(_script("bash", capsys))
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=10)
    commands = set(_complete(script, ""))
    parser_commands = {a for act in build_parser()._actions
                       if hasattr(act, "choices") and isinstance(act.choices, dict)
                       for a in act.choices}
    assert parser_commands <= commands and "--socket" in commands
    assert _complete(script, "sub") == ["submit"]
    assert _complete(script, "local", "d") == ["down"]
    assert "--discovery" in _complete(script, "local", "up", "--d")
    assert _complete(script, "--socket", "/tmp/x", "status", "--j") == ["--json"]
    assert "--stages" in _complete(script, "submit", "--st")
    (tmp_path / "job.toml").write_text("")
    assert _complete(script, "submit", str(tmp_path / "jo")) == [str(tmp_path / "job.toml")]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_name_every_command(shell: str, tmp_path: Path,
                                                 capsys: Capture) -> None:
    text = _script(shell, capsys)
    for cmd in ("status", "submit", "jobs", "dashboard", "completion", "local"):
        assert cmd in text
    exe = shutil.which(shell)
    if exe is not None:  # the shell's own parser
        f = tmp_path / f"fusionctl.{shell}"
        f.write_text(text)
        subprocess.run([exe, "-n", str(f)], check=True, timeout=10)
    if shell == "fish":
        assert "complete -c fusionctl -n '__fish_seen_subcommand_from local; and not " \
               "__fish_seen_subcommand_from up down status' -a up" in text
    else:
        assert text.startswith("#compdef fusionctl") and "bashcompinit" in text


def test_an_unknown_shell_is_a_usage_error(capsys: Capture) -> None:
    assert run(["completion", "tcsh"]) == 2
