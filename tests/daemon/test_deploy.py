"""deploy/: the systemd unit passes `systemd-analyze verify` with no warning; the example
config documents every key and is valid."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fusionctl.local import to_toml
from fusiond.config import get, keys, load_config

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "fusiond.service"
EXAMPLE = ROOT / "deploy" / "fusiond.toml"
DROP_IN = ROOT / "deploy" / "systemd" / "fusiond.service.d" / "notify-reload.conf"


def _verify(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify on `text`, with ExecStart pointed at a binary that exists here
    (verify insists the command is executable; everything else is checked as shipped)."""
    exe = Path(sys.executable).with_name("fusiond")
    if not exe.exists():
        exe = Path(shutil.which("true") or "/bin/true")
    unit = tmp_path / "fusiond.service"
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", text, flags=re.M))
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_unit_verifies_without_warnings(tmp_path: Path) -> None:
    r = _verify(tmp_path, UNIT.read_text())
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    # the check can fail: a misspelled key is only a warning, and we catch warnings
    bad = _verify(tmp_path, UNIT.read_text().replace("Restart=on-failure", "Restrat=on-failure"))
    assert "Restrat" in bad.stderr


def _systemd_version() -> int:
    r = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True,
                       timeout=30)
    m = re.search(r"systemd (\d+)", r.stdout)
    return int(m.group(1)) if m else 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_the_notify_reload_drop_in_verifies(tmp_path: Path) -> None:
    """deploy/systemd/fusiond.service.d/notify-reload.conf turns the unit into
    Type=notify-reload (systemd 253+) and drops its ExecReload; the unit with the drop-in's
    lines applied verifies clean on systemd 253+, and on an older systemd the only complaint
    is the type it does not know yet (every other key is still valid)."""
    conf = DROP_IN.read_text()
    lines = [ln.strip() for ln in conf.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines == ["[Service]", "Type=notify-reload", "ExecReload="], lines
    merged = re.sub(r"^Type=notify$", "Type=notify-reload", UNIT.read_text(), flags=re.M)
    merged = re.sub(r"^ExecReload=.*\n", "", merged, flags=re.M)
    assert "Type=notify-reload" in merged and "ExecReload" not in merged.split("[Service]")[1]
    r = _verify(tmp_path, merged)
    if _systemd_version() >= 253:
        assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    else:
        complaints = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(complaints) == 1 and "notify-reload" in complaints[0], r.stderr


def test_unit_contract() -> None:
    text = UNIT.read_text()
    lines = {ln.strip() for ln in text.splitlines() if ln and not ln.lstrip().startswith("#")}
    for needed in ("Type=notify", "Restart=on-failure", "User=fusion", "StateDirectory=fusion",
                   "RuntimeDirectory=fusion", "CacheDirectory=fusion",
                   "RestartPreventExitStatus=78", "DeviceAllow=char-nvidia-frontend rw",
                   "DeviceAllow=char-nvidia-uvm rw", "NoNewPrivileges=yes"):
        assert needed in lines, needed
    assert not any(ln.startswith("PrivateDevices=") for ln in lines)  # would hide the GPUs


def test_example_config_documents_every_key_and_is_valid(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    # every key appears as a commented assignment, under its section
    section = None
    seen: dict[str, str] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"#?\s*\[(\w+)\]\s*", line)
        if m:
            section = m.group(1)
            continue
        m = re.fullmatch(r"#\s?(\w+) = (.+)", line)
        if m:
            path = m.group(1) if section is None else f"{section}.{m.group(1)}"
            seen[path] = m.group(2)
    missing = [k.path for k in keys() if k.path not in seen]
    assert not missing, f"deploy/fusiond.toml does not document {missing}"
    # uncommented, it parses and its values are the defaults
    settings: dict[str, object] = {}
    for path, value in seen.items():
        parsed = tomllib.loads(f"v = {value}")["v"]
        if "." in path:
            sec, key = path.split(".")
            settings.setdefault(sec, {})[key] = parsed  # type: ignore[index]
        else:
            settings[path] = parsed
    f = tmp_path / "all.toml"
    f.write_text(to_toml(settings))
    loaded = load_config(path=f, env={})
    defaults = load_config(env={})
    for k in keys():
        assert get(loaded.config, k.path) == get(defaults.config, k.path), k.path


def test_daemon_docs_list_every_key() -> None:
    from fusiond.config import keys_markdown

    text = (ROOT / "docs" / "daemon.md").read_text()
    missing = [k.path for k in keys() if f"| `{k.path}` | `{k.env}` | `{k.flag}` |" not in text]
    assert not missing, f"docs/daemon.md lacks {missing}"
    assert keys_markdown() in text, ("docs/daemon.md's key table is stale: replace it with "
                                     "fusiond.config.keys_markdown()")


def test_example_config_is_generated_from_the_dataclasses() -> None:
    from fusiond.config import example_body

    assert EXAMPLE.read_text().endswith(example_body()), (
        "deploy/fusiond.toml is stale: keep its header, replace the rest with "
        "fusiond.config.example_body()")


def test_every_key_is_documented_in_help_and_example() -> None:
    from fusiond.cli import build_parser
    from fusiond.config import _DOCS

    helptext = " ".join(build_parser().format_help().split())
    example = " ".join(line.lstrip("# ") for line in EXAMPLE.read_text().splitlines())
    for k in keys():
        doc = _DOCS.get(k.path, "")
        assert doc, f"{k.path} has no docstring in fusiond/config.py"
        assert doc[:40] in helptext, k.path
        assert doc[:40] in " ".join(example.split()), k.path


def test_the_wheel_installs_what_the_unit_points_at(tmp_path: Path) -> None:
    """The distribution's name is not the package index's unrelated `fusion`; installed as
    docs/daemon.md says (a prefix standing in for the /opt/fusion venv), the unit's ExecStart
    and every Documentation= path exist, the dashboard's files come along, and the unit reads
    /etc/default/fusiond if it is there. (The old unit pointed at /usr/local/bin/fusiond and
    /usr/share/doc/fusion/, which no install created.)"""
    import tomllib
    import zipfile

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == "fusiond"
    text = UNIT.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln and not ln.lstrip().startswith("#")]
    assert "EnvironmentFile=-/etc/default/fusiond" in lines
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheel").glob("fusiond-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("app.js", "style.css", "index.html"):
        assert f"fusiond/api/static/{f}" in names
    prefix = tmp_path / "opt-fusion"
    # --ignore-installed: without it pip uninstalls this environment's own (editable) fusiond
    # before installing under the prefix
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--ignore-installed", "--prefix", str(prefix), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    exec_start = next(ln for ln in lines if ln.startswith("ExecStart=")).split("=", 1)[1]
    docs = [ln.split("=", 1)[1] for ln in lines if ln.startswith("Documentation=")]
    venv = "/opt/fusion/"
    for path in [exec_start.split()[0], *(d.removeprefix("file://") for d in docs)]:
        assert path.startswith(venv), path
        assert (prefix / path.removeprefix(venv)).is_file(), f"{path}: not installed"
    assert (prefix / "bin" / "fusionctl").is_file()
