"""A process and its descendants, read from /proc: who they are, their memory and CPU time
(for tests that hold a server's resources to a bound)."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """pid's live child processes (zombies left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def tree(pid: int) -> list[int]:
    """pid and all its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def rss_mb(pids: list[int]) -> float:
    """The processes' resident memory together, in MiB."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += int(next((ln.split()[1] for ln in status.splitlines()
                           if ln.startswith("VmRSS:")), "0"))  # fmt: skip
    return total / 1024


def cpu_seconds(pids: list[int]) -> float:
    """The processes' CPU time (user + system) so far."""
    ticks = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
