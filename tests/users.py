"""A throwaway unprivileged user for tests that check who may do what (root only): created with
its own group and home directory, removed after the test (also when it fails). `run` executes
a command as that user (`setpriv`, no supplementary groups but the test group)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FUSIONCTL = Path(sys.executable).parent / "fusionctl"


@dataclass(frozen=True)
class PlainUser:
    name: str
    uid: int
    gid: int
    home: Path

    def run(self, args: Sequence[str], timeout: float = 300.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`args` as this user (cwd: its home), capturing stdout and stderr."""
        base = {"HOME": str(self.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "PYTHONPATH": str(REPO), "USER": self.name, "LOGNAME": self.name}
        cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
               "--", *args]
        return subprocess.run(cmd, cwd=self.home, env={**base, **(env or {})}, text=True,
                              capture_output=True, timeout=timeout)

    def fusionctl(self, socket: str, *args: str, timeout: float = 300.0
                  ) -> subprocess.CompletedProcess[str]:
        return self.run([str(FUSIONCTL), "--socket", socket, *args], timeout=timeout)


def closed_to_others(paths: Sequence[Path]) -> Path | None:
    """The first directory above (or file among) `paths` another user may not traverse
    (read and run, for a file): a checkout in a 0700 temporary directory cannot run its
    fusionctl as a test user."""
    import stat

    for p in paths:
        p = Path(os.path.abspath(p))
        for d in reversed(p.parents):
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return d
        mode = os.stat(p).st_mode
        need = stat.S_IXOTH | (stat.S_IROTH if p.is_file() else 0)
        if mode & need != need:
            return p
    return None


@contextlib.contextmanager
def plain_user(prefix: str = "fzo") -> Iterator[PlainUser]:
    """A new system user and group `<prefix><hex>` with a home under /tmp; deleted at exit."""
    if os.geteuid() != 0:
        pytest.skip("creating a test user needs root")
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("useradd / setpriv not installed")
    closed = closed_to_others([REPO, FUSIONCTL, Path(sys.executable)])
    if closed is not None:
        pytest.skip(f"another user cannot reach this checkout ({closed} is closed to others): "
                    "clone it where other users may read it (e.g. under /tmp or /opt)")
    name = f"{prefix}{secrets.token_hex(3)}"
    home = Path(f"/tmp/{name}-home")
    got = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                          "--home-dir", str(home), "--shell", "/usr/sbin/nologin", name],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"useradd failed: {got.stderr.strip()}")
    try:
        import pwd

        pw = pwd.getpwnam(name)
        home.mkdir(mode=0o700)
        os.chown(home, pw.pw_uid, pw.pw_gid)
        yield PlainUser(name, pw.pw_uid, pw.pw_gid, home)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def let_in(socket: str, user: PlainUser) -> None:
    """Let `user` reach the API socket as a member of its group would: the socket's group
    becomes the user's group, and every directory above it becomes traversable."""
    p = Path(socket)
    os.chown(p, 0, user.gid)
    for d in p.parents:
        if d == Path("/"):
            break
        mode = d.stat().st_mode & 0o777
        if not mode & 0o001:
            os.chmod(d, mode | 0o001)
