"""Peer discovery: zeroconf (`_fusion._tcp`) on the LAN plus bootstrap addresses for the WAN.

Both sources feed one callback, ``on_found(node_id, address, source)``. Discovery only finds
*candidates*: a peer becomes a cluster member once it has been heard from (see membership), so a
stale mDNS record or a mistyped bootstrap address never adds a voter.

- mDNS: this node registers ``<node id>._fusion._tcp.local.`` with TXT ``node_id``,
  ``cluster_id``, ``port`` and ``proto`` (protocol version), bound to the configured interfaces
  only (tests bind ``127.0.0.1``: never multicast on a real interface from a test). Records of
  another cluster id, of this node, or without a node id are ignored.
- Bootstrap: each address is dialled (``connect`` returns the peer's node id after the
  handshake) every ``retry_s`` until its first success; after that gossip keeps the peer known.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from fusiond.cluster.errors import DiscoveryError
from fusiond.errors import SelfAddress
from protocol import PROTOCOL_VERSION

log = logging.getLogger(__name__)

Address = tuple[str, int]
Source = Literal["mdns", "bootstrap"]
FoundCallback = Callable[[str, Address, Source], None]
ConnectFn = Callable[[Address], Awaitable[str]]

SERVICE_TYPE = "_fusion._tcp.local."
_MAX_LABEL = 63  # DNS label limit: the instance name is truncated, the TXT keeps the full id


def parse_txt(properties: dict[bytes, bytes | None]) -> dict[str, str]:
    """Decode a TXT record to str -> str, dropping keys or values that are not UTF-8."""
    out: dict[str, str] = {}
    for key, value in properties.items():
        if value is None:
            continue
        try:
            out[key.decode()] = value.decode()
        except UnicodeDecodeError:
            continue
    return out


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


class MdnsDiscovery:
    """Advertise this node and browse for others over zeroconf's asyncio API."""

    def __init__(
        self,
        *,
        node_id: str,
        cluster_id: str,
        advertise: Address,
        on_found: FoundCallback,
        interfaces: Sequence[str] | None,
        service_type: str = SERVICE_TYPE,
        request_timeout_s: float = 3.0,
    ) -> None:
        self._node_id = node_id
        self._cluster_id = cluster_id
        self._advertise = advertise
        self._on_found = on_found
        self._interfaces = list(interfaces) if interfaces is not None else None
        self._service_type = service_type
        self._request_timeout_s = request_timeout_s
        self._azc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def _addresses(self) -> list[bytes]:
        host = self._advertise[0]
        if not _is_unspecified(host):
            try:
                # A host name is resolved once: mDNS records carry addresses, not names.
                return [socket.inet_aton(socket.gethostbyname(host))]
            except OSError as exc:
                raise DiscoveryError(
                    f"cannot advertise {host!r} over mDNS (IPv4 addresses or names only): {exc}"
                ) from exc
        # Listening on all interfaces: advertise the configured interfaces' addresses.
        out = []
        for iface in self._interfaces or []:
            with contextlib.suppress(OSError):
                out.append(socket.inet_aton(iface))
        if not out:
            raise DiscoveryError(
                f"cannot advertise unspecified address {host!r} over mDNS without "
                "mdns_interfaces naming the IPv4 addresses to advertise"
            )
        return out

    async def start(self) -> None:
        """Register this node's service and start browsing; raise DiscoveryError on failure."""
        interfaces = self._interfaces if self._interfaces is not None else None
        addresses = self._addresses()  # before opening sockets: a bad address leaks nothing
        try:
            if interfaces is None:
                self._azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
            else:
                self._azc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        except OSError as exc:
            raise DiscoveryError(f"cannot start mDNS on {interfaces or 'all'}: {exc}") from exc
        label = self._node_id[:_MAX_LABEL]
        self._info = AsyncServiceInfo(
            self._service_type,
            f"{label}.{self._service_type}",
            addresses=addresses,
            port=self._advertise[1],
            properties={
                "node_id": self._node_id,
                "cluster_id": self._cluster_id,
                "port": str(self._advertise[1]),
                "proto": str(PROTOCOL_VERSION),
            },
            server=f"{label}.local.",
        )
        try:
            # allow_name_change: a previous run's record may still linger in caches.
            await self._azc.async_register_service(self._info, allow_name_change=True)
        except Exception as exc:
            await self._azc.async_close()
            self._azc = None
            raise DiscoveryError(f"cannot register mDNS service: {exc}") from exc
        self._browser = AsyncServiceBrowser(
            self._azc.zeroconf, self._service_type, handlers=[self._on_state_change]
        )

    def _on_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        # Called from zeroconf's loop callbacks (same loop): keep it short, resolve in a task.
        if self._closed or state_change is ServiceStateChange.Removed:
            return
        task = asyncio.get_running_loop().create_task(self._resolve(service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        azc = self._azc
        if azc is None:
            return
        info = AsyncServiceInfo(service_type, name)
        try:
            ok = await info.async_request(azc.zeroconf, self._request_timeout_s * 1000)
        except Exception as exc:  # a malformed record must not stop discovery
            log.debug("mDNS: cannot resolve %s: %s", name, exc)
            return
        if not ok:
            return
        txt = parse_txt(info.properties)
        node_id = txt.get("node_id")
        if not node_id or node_id == self._node_id:
            return
        if txt.get("cluster_id") != self._cluster_id:
            log.debug("mDNS: ignoring %s of cluster %r", node_id, txt.get("cluster_id"))
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        port = info.port
        if not addresses or port is None:
            return
        self._on_found(node_id, (addresses[0], port), "mdns")

    async def close(self) -> None:
        """Unregister, stop browsing and close zeroconf; idempotent."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        browser, self._browser = self._browser, None
        if browser is not None:
            await browser.async_cancel()
        azc, self._azc = self._azc, None
        if azc is not None:
            if self._info is not None:
                with contextlib.suppress(Exception):
                    await azc.async_unregister_service(self._info)
            await azc.async_close()


class BootstrapDialer:
    """Dial each bootstrap address until its first success, then report the peer found."""

    def __init__(self, *, connect: ConnectFn, on_found: FoundCallback, retry_s: float) -> None:
        self._connect = connect
        self._on_found = on_found
        self._retry_s = retry_s
        self._tasks: dict[Address, asyncio.Task[None]] = {}
        self._done: set[Address] = set()
        self._closed = False

    def add(self, address: Address) -> None:
        """Start dialling `address` (no-op if it is already being dialled or has succeeded)."""
        if self._closed or address in self._tasks or address in self._done:
            return
        task = asyncio.get_running_loop().create_task(self._dial(address))
        self._tasks[address] = task

    def pending(self) -> list[Address]:
        """Addresses not yet reached."""
        return [a for a in self._tasks if a not in self._done]

    async def _dial(self, address: Address) -> None:
        attempt = 0
        while True:
            try:
                peer = await self._connect(address)
            except asyncio.CancelledError:
                raise
            except SelfAddress:
                # Our own address (e.g. our own join token's): nothing to find there, ever.
                log.debug("bootstrap %s:%d is this node itself; not dialled again", *address)
                self._done.add(address)
                return
            except Exception as exc:
                attempt += 1
                # Log the first failure and then rarely: an unreachable seed retries forever.
                level = logging.INFO if attempt == 1 or attempt % 30 == 0 else logging.DEBUG
                log.log(level, "bootstrap %s:%d unreachable (attempt %d): %s",
                        address[0], address[1], attempt, exc)
                await asyncio.sleep(self._retry_s)
                continue
            self._done.add(address)
            self._on_found(peer, address, "bootstrap")
            return

    async def close(self) -> None:
        """Cancel and await every dialling task; idempotent."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
