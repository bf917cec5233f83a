"""Whether a peer rank's process still runs, where it shares this machine (Linux).

A rank's heartbeat goes stale seconds after it was killed; on one machine its process
says so at once. Each rank publishes where it runs (:func:`whereabouts`: the machine, its
boot, its PID namespace, its pid and the process's start time, so a reused pid is not
taken for it) and a peer on the same machine reads its fate from ``/proc``
(:func:`fate`). Elsewhere (another machine, no ``/proc``) nothing is known, and the
heartbeat alone tells.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

Fate = Literal["ended", "stopped"]


def machine() -> str | None:
    """This machine, its boot and its PID namespace: pids mean the same process only
    where all three match. None where ``/proc`` does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{namespace}"


def _stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of process ``pid``; None if none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def whereabouts() -> str:
    """This process, as a peer can find it ("" where ``/proc`` does not say)."""
    here, stat = machine(), _stat(os.getpid())
    if here is None or stat is None:
        return ""
    return f"{os.getpid()}|{stat[1]}|{here}"


def fate(published: str, here: str | None) -> Fate | None:
    """What became of the process a peer published (:func:`whereabouts`): "ended" (gone,
    a zombie, or its pid taken by another), "stopped" (SIGSTOP, a debugger), or None
    (it runs, or it is not on this machine, or nothing is known). ``here``: this
    machine (:func:`machine`, read once by the caller)."""
    pid, _, rest = published.partition("|")
    start, _, where = rest.partition("|")
    if here is None or where != here:
        return None
    try:
        stat = _stat(int(pid))
    except ValueError:
        return None
    if stat is None or stat[1] != start or stat[0] in "ZXx":
        return "ended"
    return "stopped" if stat[0] in "Tt" else None
