"""systemd's notify protocol (sd_notify(3)) without libsystemd: one datagram per message to $NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

__all__ = ["notify", "start_watchdog", "watchdog_interval"]

log = logging.getLogger("gpubroker.server")


def _notify_address() -> str | None:
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        return "\0" + address[1:]  # Linux's abstract namespace, as systemd writes it
    if address.startswith("/"):
        return address
    return None  # unset, or a vsock: address (systemd >= 254 in VMs), which we do not speak


def notify(*states: str) -> bool:
    """Send ``KEY=VALUE`` states to the service manager; False when none listens or the message was dropped."""
    address = _notify_address()
    if address is None or not states:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        # Never block the event loop on a busy manager: a dropped ping is better than a stalled broker.
        sock.setblocking(False)
        try:
            sock.sendto("\n".join(states).encode(), address)
        except OSError as exc:
            log.warning("sd_notify %s to %s failed: %s", ",".join(states), os.environ.get("NOTIFY_SOCKET"), exc)
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of WatchdogSec= (as sd_watchdog_enabled(3) advises), or None when no watchdog is asked of this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec or (pid and pid != str(os.getpid())):
        return None  # unset, or inherited by us from a parent that the watchdog is really meant for
    try:
        seconds = int(usec) / 1e6
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return seconds / 2 if seconds > 0 else None


async def _ping_watchdog(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def start_watchdog() -> asyncio.Task[None] | None:
    """Ping the watchdog from the event loop, so a stalled loop stops the pings and systemd restarts us."""
    interval = watchdog_interval()
    if interval is None or _notify_address() is None:
        return None
    return asyncio.get_running_loop().create_task(_ping_watchdog(interval), name="sd-watchdog")
