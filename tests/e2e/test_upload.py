"""The job upload and the local API's request checks: the codec refuses malformed bodies naming
the part; the API spools an upload to a private file (removed after), refuses one past
`api.max_upload_bytes` before handing it to the daemon, refuses absurd numbers with a 400
naming the field, and tells the backend who is calling (SO_PEERCRED). No daemons here: an
ApiServer with a recording backend (tests/e2e/test_trust.py has real ones)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from fusiond.api import ApiServer
from fusiond.jobs.upload import MAGIC, UploadError, decode_upload, encode_upload

META = {"toml": "[job]\nsteps = 1\n", "base": "/tmp", "out_base": "/tmp", "stages": 2}


def test_upload_round_trip() -> None:
    up = decode_upload(encode_upload(META, b"graph", b"\x00weights"))
    assert up.meta == META and up.graph_bytes == b"graph" and up.state_bytes == b"\x00weights"
    assert up.data_bytes == b""  # no corpus section: the stages read the default corpus
    up = decode_upload(encode_upload(META, b"graph", b"w", b"corpus"))
    assert up.state_bytes == b"w" and up.data_bytes == b"corpus"


@pytest.mark.parametrize(("body", "needle"), [
    (b"GARBAGE", "bad magic"),
    (MAGIC + b"\x00\x00", "before its meta"),
    (encode_upload(META, b"graph", b"w")[:-1], "truncated in its weights"),
    (encode_upload(META, b"graph", b"w") + b"x", "before its data"),
    (encode_upload(META, b"graph", b"w", b"d")[:-1], "truncated in its data"),
    (encode_upload(META, b"graph", b"w", b"d") + b"x", "after the last section"),
    (encode_upload({"toml": 1, "base": "", "out_base": ""}, b"", b""), "meta.toml"),
])
def test_malformed_uploads_are_refused(body: bytes, needle: str) -> None:
    with pytest.raises(UploadError, match=needle):
        decode_upload(body)


class _Backend:
    """The API's backend, recording what reaches it (routes are bound at start; the others
    are never called here)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.got: list[int] = []
        self.callers: list[Any] = []
        self.spools: list[Path] = []

    def upload_dir(self) -> Path:
        return self.root / "uploads"

    async def submit_job(self, spool: Path, dry_run: bool, caller: Any) -> dict[str, Any]:
        self.spools.append(spool)
        self.got.append(await asyncio.to_thread(os.path.getsize, spool))
        self.callers.append(caller)
        return {"bytes": self.got[-1], "dry_run": dry_run}

    def job(self, job_id: str, history: int, caller: Any) -> dict[str, Any]:
        self.callers.append(caller)
        return {"job_id": job_id, "history": history}

    async def token(self, body: Any) -> dict[str, Any]:
        from fusiond.api.server import body_bool, body_number

        return {"ttl_s": body_number(body, "ttl_s", 60.0, lo=0.0, hi=3600.0, lo_open=True),
                "one_time": body_bool(body, "one_time", True)}

    def __getattr__(self, name: str) -> Any:
        async def unused(*args: Any) -> dict[str, Any]:
            raise AssertionError(f"{name} called")

        return unused


async def _server(tmp_path: Path, backend: _Backend, limit: int = 1 << 20
                  ) -> tuple[ApiServer, Any]:
    from fusionctl.client import Client, Endpoint

    sock = str(tmp_path / "api.sock")
    server = ApiServer(backend, socket_path=sock, max_upload_bytes=limit)  # type: ignore[arg-type]
    await server.start()
    return server, Client(Endpoint(socket_path=sock), timeout=10)


async def test_api_spools_uploads_and_bounds_their_size(tmp_path: Path) -> None:
    from fusionctl.client import ApiFailure

    backend = _Backend(tmp_path)
    server, client = await _server(tmp_path, backend)
    try:
        small = b"x" * (300 << 10)  # above the 64 kB JSON limit, below the upload limit
        res = await asyncio.to_thread(client.request, "POST", "/v1/jobs?dry_run=1", None, small)
        assert res == {"bytes": len(small), "dry_run": True}
        # spooled to a private file in the backend's directory, removed after the request
        assert backend.spools[0].parent == tmp_path / "uploads"
        assert (tmp_path / "uploads").stat().st_mode & 0o777 == 0o700
        assert not backend.spools[0].exists()
        with pytest.raises(ApiFailure) as e:  # refused on its Content-Length, before reading
            await asyncio.to_thread(client.request, "POST", "/v1/jobs", None, b"x" * (2 << 20))
        assert e.value.status == 413 and "api.max_upload_bytes=1048576" in e.value.message
        assert backend.got == [len(small)]  # the oversized one never reached the daemon
        assert list((tmp_path / "uploads").iterdir()) == []
    finally:
        await server.close()
    assert json.dumps(res)


async def test_a_chunked_upload_is_cut_off_at_the_limit(tmp_path: Path) -> None:
    """Without a Content-Length the API reads until the limit, answers 413 and removes the
    part it spooled."""
    import http.client
    import socket

    backend = _Backend(tmp_path)
    server, _ = await _server(tmp_path, backend)

    def post() -> tuple[int, bytes]:
        class Unix(http.client.HTTPConnection):
            def connect(self) -> None:
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(tmp_path / "api.sock"))
                self.sock = s

        c = Unix("localhost", timeout=10)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            c.request("POST", "/v1/jobs", body=iter([b"y" * (256 << 10)] * 16),
                      encode_chunked=True)
        r = c.getresponse()
        return r.status, r.read()

    try:
        status, body = await asyncio.to_thread(post)
        assert status == 413 and b"api.max_upload_bytes" in body
        assert backend.got == [] and list((tmp_path / "uploads").iterdir()) == []
    finally:
        await server.close()


@pytest.mark.parametrize(("body", "needle"), [
    ({"ttl_s": 1e300}, "ttl_s must be a number in (0, 3600], got 1e+300"),
    ({"ttl_s": -5}, "ttl_s must be a number in (0, 3600], got -5"),
    ({"ttl_s": 0}, "got 0"),
    ({"ttl_s": True}, "got True"),
    ({"ttl_s": "60"}, "got '60'"),
    ({"one_time": 1}, "one_time must be true or false, got 1"),
])
async def test_absurd_numbers_are_a_400_naming_the_field(tmp_path: Path, body: dict[str, Any],
                                                         needle: str) -> None:
    from fusionctl.client import ApiFailure

    server, client = await _server(tmp_path, _Backend(tmp_path))
    try:
        with pytest.raises(ApiFailure) as e:
            await asyncio.to_thread(client.request, "POST", "/v1/token", body)
        assert e.value.status == 400 and needle in e.value.message, e.value.message
    finally:
        await server.close()


async def test_nan_and_infinity_in_json_are_refused(tmp_path: Path) -> None:
    """Python's JSON reader accepts NaN and Infinity (and 1e999 reads as inf): each is a 400,
    never a 500."""
    import http.client
    import socket

    server, _ = await _server(tmp_path, _Backend(tmp_path))

    def post(raw: bytes) -> tuple[int, bytes]:
        class Unix(http.client.HTTPConnection):
            def connect(self) -> None:
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(tmp_path / "api.sock"))
                self.sock = s

        c = Unix("localhost", timeout=10)
        c.request("POST", "/v1/token", body=raw, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()

    try:
        for raw in (b'{"ttl_s": NaN}', b'{"ttl_s": Infinity}', b'{"ttl_s": 1e999}',
                    b'{"ttl_s": -Infinity}'):
            status, body = await asyncio.to_thread(post, raw)
            assert status == 400 and b"ttl_s must be a number" in body, (raw, body)
    finally:
        await server.close()


async def test_the_api_knows_the_calling_user(tmp_path: Path) -> None:
    """SO_PEERCRED: the backend gets the uid, gid and pid of the process on the socket."""
    backend = _Backend(tmp_path)
    server, client = await _server(tmp_path, backend)
    try:
        await asyncio.to_thread(client.get, "/v1/jobs/j-1?history=3")
        caller = backend.callers[-1]
        assert (caller.via, caller.uid, caller.gid, caller.pid) == (
            "unix", os.getuid(), os.getgid(), os.getpid())
        from fusionctl.client import ApiFailure

        for bad in ("-1", "1e3", "100001", "x"):
            with pytest.raises(ApiFailure) as e:
                await asyncio.to_thread(client.get, f"/v1/jobs/j-1?history={bad}")
            assert e.value.status == 400 and "history must be an integer" in e.value.message
    finally:
        await server.close()


def test_upload_meta_numbers_are_checked() -> None:
    from fusiond.jobs.upload import check_meta

    for meta, needle in (({"steps": 0}, "steps"), ({"steps": True}, "steps"),
                         ({"steps": 10**12}, "steps"), ({"stages": 1.5}, "stages"),
                         ({"first_step": -1}, "first_step"), ({"restarts": 101}, "restarts"),
                         ({"x": float("nan")}, "finite"), ({"data_digest": "../x"}, "hex"),
                         ({"job_id": "../../etc"}, "job id"), ({"data_default": 1}, "true")):
        with pytest.raises(UploadError, match=needle):
            check_meta(meta)
    check_meta({"steps": 5, "stages": 2, "first_step": 0, "restarts": 0, "data_digest": "ab"})
