"""Where an HTTP client may send a prompt's cache, and what it is told when a band fails.

A ``/v1/prefill`` body's ``"handoff": "ADDRESS"`` makes every stage connect to ADDRESS and
write its band there. Left open, that lets any client point the pipeline at any host and
port (a port scanner, and a way to push caches into someone else's decoder). So a
per-request address is refused (403) unless it is one of the run's own — ``--handoff-to``,
the server's ``--decode`` — or matches a pattern of ``--handoff-allow`` (comma-separated):

- ``unix:/path`` and ``tcp://host:port``: that address exactly;
- ``unix:/dir/*``: a shell pattern over the socket's path (``fnmatch``);
- ``tcp://CIDR:PORTS``: an IP address in the network (``10.0.0.0/8``, ``[fd00::]/8``, a
  single address) at PORTS — one port, a range ``9000-9100``, or ``*``. A host *name* in a
  request matches only a pattern naming that host (``tcp://decoder.local:*``): a name is
  not resolved here, since the stages resolve it again later and could get another
  address.

``pull:`` (the band waits on the stages' own band servers) and ``true`` (the run's default
target) are always allowed. The Python API and requests files are the operator's and are
not checked.

What a client hears of a band that failed is as coarse (:func:`client_handoff`): failed,
refused, timed out or cancelled, and no detail; the full summary goes to the server's log.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from wavepp.handoff.wire import PULL_TARGET, Address, parse_address


class AllowError(ValueError):
    """A ``--handoff-allow`` pattern that is not one (the message names it)."""


@attrs.frozen
class _Pattern:
    kind: str  # "unix" or "tcp"
    path: str = ""  # unix: an fnmatch pattern
    host: str = ""  # tcp by name: the name, lower case
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None  # tcp by address
    ports: tuple[int, int] = (1, 65535)  # inclusive

    def matches(self, address: Address) -> bool:
        if address.kind != self.kind:
            return False
        if self.kind == "unix":
            return fnmatch.fnmatchcase(address.path, self.path)
        if not self.ports[0] <= address.port <= self.ports[1]:
            return False
        if self.network is None:
            return address.host.lower() == self.host
        try:
            return ipaddress.ip_address(address.host) in self.network
        except ValueError:  # a host name: only a pattern naming it matches
            return False


def _pattern(text: str) -> _Pattern:
    def bad(why: str) -> AllowError:
        return AllowError(f"--handoff-allow {text!r}: {why}; patterns are unix:/path, "
                          "unix:/dir/*, tcp://host:port, tcp://CIDR:PORT, tcp://CIDR:LOW-HIGH "
                          "or tcp://CIDR:*")  # fmt: skip

    if text.startswith("unix:"):
        if not text[len("unix:"):].startswith("/"):
            raise bad("the path must be absolute")
        return _Pattern("unix", path=text[len("unix:"):])
    if not text.startswith("tcp://"):
        raise bad("unknown form")
    host, sep, ports_text = text[len("tcp://"):].rpartition(":")
    if not sep or not host:
        raise bad("no :PORT")
    if ports_text == "*":
        ports = (1, 65535)
    else:
        low, _, high = ports_text.partition("-")
        if not (low.isdigit() and (high.isdigit() or not high)):
            raise bad(f"ports {ports_text!r} are not PORT, LOW-HIGH or *")
        ports = (int(low), int(high or low))
        if not 1 <= ports[0] <= ports[1] <= 65535:
            raise bad(f"ports {ports_text!r} are outside 1..65535 or reversed")
    bare = host[1:].replace("]", "", 1) if host.startswith("[") else host
    try:
        network = ipaddress.ip_network(bare, strict=False)
    except ValueError:
        if "/" in host or host.startswith("["):
            raise bad(f"{host!r} is not a network") from None
        try:
            parse_address(f"tcp://{host}:1")
        except ValueError:
            raise bad(f"{host!r} is not a host name") from None
        return _Pattern("tcp", host=host.lower(), ports=ports)
    return _Pattern("tcp", network=network, ports=ports)


@attrs.frozen
class HandoffAllow:
    """The addresses a client may name: the run's own, and the operator's patterns."""

    own: frozenset[str] = frozenset()  # the run's --handoff-to and the server's --decode
    patterns: tuple[_Pattern, ...] = ()

    @classmethod
    def parse(cls, patterns: str | None, own: Iterable[str | None] = ()) -> HandoffAllow:
        """``patterns``: ``--handoff-allow`` (comma-separated); AllowError naming a bad one."""
        texts = [p.strip() for p in (patterns or "").split(",") if p.strip()]
        return cls(frozenset(a for a in own if a), tuple(_pattern(t) for t in texts))

    def problem(self, target: str | bool | None) -> str | None:
        """Why a client may not send its cache to ``target``, or None."""
        if target is None or target is True or target is False or target == PULL_TARGET:
            return None
        if target in self.own:
            return None
        try:
            address = parse_address(target)
        except ValueError:
            return None  # the runtime refuses it with its own reason (400)
        if any(p.matches(address) for p in self.patterns):
            return None
        return (f"handoff address {target!r:.200} is not allowed: this server sends caches "
                "only to its own --handoff-to / --decode and to --handoff-allow's patterns")


# What a client hears of a band's reason (wavepp.handoff.base.REASONS): nothing that tells
# a closed port from an open one beyond what timing does.
_COARSE = {"refused": "refused", "timeout": "timed out", "expired": "timed out",
           "cancelled": "cancelled"}  # fmt: skip


def coarse(reason: str | None) -> str | None:
    """A band's reason as a client hears it: failed, refused, timed out or cancelled."""
    return None if reason is None else _COARSE.get(reason, "failed")


def client_handoff(summary: Mapping[str, Any]) -> dict:
    """A request's handoff summary as a client gets it: the status, coarse reasons, and
    per stage whether it went through (with its bytes and times when it did)."""
    failed = summary.get("status") == "failed"
    reason = coarse(summary.get("reason"))
    stages = []
    for stage in summary.get("stages") or ():
        ok = bool(stage.get("ok"))
        shown = {"stage": stage.get("stage"), "ok": ok,
                 "reason": None if ok else coarse(stage.get("reason"))}  # fmt: skip
        if ok:
            shown.update({k: stage.get(k) for k in ("bytes", "seconds", "wire_s", "ended_at")})
        stages.append(shown)
    return {
        **{k: v for k, v in summary.items() if k not in ("reason", "error", "stages")},
        "reason": reason,
        "error": f"the handoff {reason}: the server's log has the details" if failed else None,
        "stages": stages,
    }
