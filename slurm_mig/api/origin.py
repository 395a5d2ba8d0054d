"""Is a request for node N sent from N's host? The MUNGE credential's origin against Slurm's NodeAddr.

A node's root can sign requests (it holds the MUNGE key, as for Slurm itself), so a signature alone
lets a compromised node speak for any other node: record false outcomes for its jobs, release its
bindings, make the controller plan re-carves there (docs/security.md §7). munged writes the address
of the host that *encoded* a credential into it (``ENCODE_HOST``: the host's own address, or
``munged --origin``), and the munge client cannot choose it. So the controller compares that
address with the claimed node's ``NodeAddr`` from Slurm.

What it catches: a node that sends for another node through its own host's munged (a misconfigured
or misrouted node, a hook run with the wrong ``--node``, a careless intruder). What it cannot stop:
a node's root, who can start a munged of its own with ``--origin`` set to another node's address
(the tests do exactly that) or build credentials with the key, which is the same on every host.
So it is a tripwire, not a boundary; a key per node is the boundary (``[auth].hmac_node_keys_dir``,
docs/security.md §7).

Three modes (``[auth].node_origin``): ``off``; ``warn`` (the default: a mismatch is counted and
logged, the request is served), so that a site can see what its nodes send before it enforces;
``enforce``: a mismatch is refused (403). A node whose address is not known yet, or does not
resolve, cannot be checked: it is served and counted as unchecked. Nodes whose NodeAddr is this
host (the local test cluster: every node is 127.0.0.1) may send from any of this host's addresses.

Addresses are resolved in the controller's tick (``update``), never while a request waits.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

log = logging.getLogger("slurm_mig.api.origin")

MODES = ("off", "warn", "enforce")
_IPV4 = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")


def resolve_ipv4(name: str) -> frozenset[str]:
    """IPv4 addresses of a host name or address; empty when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset(str(i[4][0]) for i in infos)


def encode_address(host: str) -> str:
    """The IPv4 address in what MUNGE says of the encoding host: libmunge gives ``10.0.0.5``, the
    unmunge command ``node5 (10.0.0.5)``. "" when there is none."""
    found = _IPV4.findall(host or "")
    if not found:
        return ""
    try:
        addr = ipaddress.IPv4Address(found[-1])
    except ValueError:
        return ""
    # munged says 0.0.0.0 when it could not tell its own address (a host name that does not resolve)
    return "" if addr.is_unspecified else str(addr)


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Verdict:
    """``ok``: the origin matches, or cannot be checked (``checked`` False); ``why``: for the log;
    ``quiet``: nothing an admin need hear (a node Slurm has not listed yet, as before the first tick)."""

    ok: bool
    checked: bool
    why: str
    quiet: bool = False


class NodeOrigins:
    """Each node's addresses as Slurm knows them, and the check of a credential's origin against them."""

    def __init__(self, *, resolver: Callable[[str], frozenset[str]] = resolve_ipv4,
                 local_names: Iterable[str] | None = None, refresh_s: float = 600.0,
                 budget_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.resolver = resolver
        self.refresh_s = refresh_s
        self.budget_s = budget_s  # DNS time one update may spend; the rest waits for the next tick
        self.clock = clock
        self._local_names = tuple(local_names) if local_names is not None else None
        self._lock = threading.Lock()
        self._addr: dict[str, str] = {}  # node -> NodeAddr as Slurm says
        self._resolved: dict[str, tuple[frozenset[str], float]] = {}  # NodeAddr -> (addresses, when)
        self._local: frozenset[str] = frozenset()
        self._local_at = float("-inf")

    def update(self, nodes: Iterable) -> None:
        """Take each node's ``address`` (NodeAddr; its name where Slurm gives none) from a Slurm query
        and resolve the ones not resolved in the last ``refresh_s`` seconds (DNS here, not per request)."""
        now = self.clock()
        addrs = {n.name: (getattr(n, "address", "") or n.name) for n in nodes}
        local = None
        if now - self._local_at >= self.refresh_s:
            if self._local_names is None:  # here, not in __init__: getfqdn() may wait on DNS
                self._local_names = (socket.gethostname(), socket.getfqdn())
            local = frozenset().union(*(self.resolver(n) for n in self._local_names if n))
        # Never resolved first, then the stalest.
        todo = sorted((a for a in set(addrs.values())
                       if a not in self._resolved or now - self._resolved[a][1] >= self.refresh_s),
                      key=lambda a: self._resolved.get(a, (None, float("-inf")))[1])
        fresh: dict[str, tuple[frozenset[str], float]] = {}
        t0 = time.monotonic()
        for a in todo:
            if time.monotonic() - t0 > self.budget_s:
                break
            got = self.resolver(a)
            if not got and a in self._resolved:  # a DNS hiccup does not forget what a node's address was
                got = self._resolved[a][0]
            fresh[a] = (got, now)
        with self._lock:
            self._addr.update(addrs)
            self._resolved.update(fresh)
            if local is not None:
                self._local, self._local_at = local, now

    def check(self, node: str, encode_host: str) -> Verdict:
        """Whether a credential encoded on ``encode_host`` may speak for ``node``."""
        sender = encode_address(encode_host)
        with self._lock:
            addr = self._addr.get(node)
            known = addr is not None and addr in self._resolved
            resolved = self._resolved[addr][0] if known else frozenset()
            local = self._local
        if addr is None:
            return Verdict(True, False, f"node {node} is not known to Slurm yet", quiet=True)
        if not known:
            return Verdict(True, False, f"node {node}'s NodeAddr {addr!r} is not resolved yet", quiet=True)
        if not resolved:
            return Verdict(True, False, f"node {node}'s NodeAddr {addr!r} does not resolve")
        if not sender:
            return Verdict(True, False, f"the credential names no IPv4 origin ({encode_host!r})")
        if any(_loopback(a) or a in local for a in resolved):
            # The node is this host: its munged may say any of this host's addresses.
            if _loopback(sender) or sender in local:
                return Verdict(True, True, "")
            return Verdict(False, True, f"node {node} is this host ({addr}), but the credential was "
                                        f"encoded on {sender}")
        if sender in resolved:
            return Verdict(True, True, "")
        return Verdict(False, True, f"node {node}'s NodeAddr {addr} is {', '.join(sorted(resolved))}, but the "
                                    f"credential was encoded on {sender}")
