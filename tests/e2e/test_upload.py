"""The job upload: its codec refuses malformed bodies naming the part, and the local API
refuses an upload past `api.max_upload_bytes` before handing it to the daemon (no daemons
here: an ApiServer with a recording backend)."""

from __future__ import annotations

import asyncio
import json
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
    def __init__(self) -> None:
        self.got: list[int] = []

    async def submit_job(self, data: bytes, dry_run: bool) -> dict[str, Any]:
        self.got.append(len(data))
        return {"bytes": len(data), "dry_run": dry_run}

    def __getattr__(self, name: str) -> Any:
        # The rest of the Backend: routes are bound at start, never called here.
        async def unused(*args: Any) -> dict[str, Any]:
            raise AssertionError(f"{name} called")

        return unused


async def test_api_streams_uploads_and_bounds_their_size(tmp_path: Path) -> None:
    from fusionctl.client import ApiFailure, Client, Endpoint

    backend = _Backend()
    sock = str(tmp_path / "api.sock")
    server = ApiServer(backend, socket_path=sock, max_upload_bytes=1 << 20)  # type: ignore[arg-type]
    await server.start()
    try:
        client = Client(Endpoint(socket_path=sock), timeout=10)
        small = b"x" * (300 << 10)  # above the 64 kB JSON limit, below the upload limit
        res = await asyncio.to_thread(client.request, "POST", "/v1/jobs?dry_run=1", None, small)
        assert res == {"bytes": len(small), "dry_run": True}
        with pytest.raises(ApiFailure) as e:
            await asyncio.to_thread(client.request, "POST", "/v1/jobs", None, b"x" * (2 << 20))
        assert e.value.status == 413 and "api.max_upload_bytes=1048576" in e.value.message
        assert backend.got == [len(small)]  # the oversized one never reached the daemon
    finally:
        await server.close()
    assert json.dumps(res)
