"""The worker process: its entry point and its loop, serving the front and any client links.

A fatal device error (a corrupted CUDA context) is reported, then the process exits, so the tenant's next
session starts on a fresh context.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import select
import selectors
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Literal

import msgspec

from gpubroker.broker.worker._main import EXIT_FATAL, WorkerServer
from gpubroker.wire.errors import GpuBrokerError, Internal, InvalidArgument
from gpubroker.wire.worker import (
    CONTROL,
    MAX_FRAME,
    FrameClosed,
    FromWorker,
    Grant,
    Revoke,
    Yield,
    decode_to_worker,
    decode_worker_message,
    encode,
    recv_payload,
    send_payload,
)

__all__ = ["main", "serve"]

log = logging.getLogger("gpubroker.worker")


def _reply(sock: socket.socket, req_id: int, status: Literal[0, 1], body: object) -> None:
    send_payload(sock, encode(FromWorker(req_id, status, body)))


def _serve_front(sock: socket.socket, server: WorkerServer) -> int | None:
    """One request (or lease message) from the front; an exit code when the worker must stop."""
    try:
        payload = recv_payload(sock, MAX_FRAME)
    except FrameClosed:
        return 0
    # The front's frames are the front's (trusted): one that is not even an envelope is a bug on its side, and the
    # worker stops rather than guess which request it was.
    frame = decode_to_worker(payload)
    fatal = False
    what = "a request"
    try:
        message = decode_worker_message(frame.body)
        what = type(message).__name__
        if isinstance(message, (Grant, Yield, Revoke)):
            if frame.id == CONTROL:
                server.links.on_control(message)
                return None
            raise InvalidArgument(f"a lease message ({type(message).__name__}) with a request's id")
        if frame.id == CONTROL:
            raise InvalidArgument(f"a request ({type(message).__name__}) with the lease messages' id")
        reply: tuple[Literal[0, 1], object] = (0, server.handle(frame.session, message))
    except msgspec.DecodeError as exc:
        reply = (1, InvalidArgument(f"malformed worker request: {exc}").as_wire())
    except GpuBrokerError as exc:
        fatal = bool(exc.details.get("fatal"))
        reply = (1, exc.as_wire())
    except Exception as exc:  # a bug or an untranslated runtime error: report it, keep serving
        log.exception("worker request %s failed", what)
        reply = (1, Internal(f"{type(exc).__name__}: {exc}").as_wire())
    if frame.id != CONTROL:
        _reply(sock, frame.id, *reply)
    else:  # (nothing to answer: a lease message has no reply)
        log.error("a lease message the worker cannot take: %s", reply[1])
    return EXIT_FATAL if fatal else None


def serve(sock: socket.socket, server: WorkerServer) -> int:
    """Serve the front and any client links until the front closes its socket; returns the exit code."""
    server.front = sock
    links = server.links
    # poll(2), never epoll: the sandbox refuses epoll instances (sandbox/_seccomp.py, HOST_USER_COUNTS).
    selector = selectors.PollSelector()
    selector.register(sock, selectors.EVENT_READ)
    front_poll = select.poll()
    front_poll.register(sock, select.POLLIN)
    links.front_waiting = lambda: bool(front_poll.poll(0))
    front, version = sock.fileno(), -1
    watched: dict[int, tuple[socket.socket, int]] = {}
    while True:
        if version != links.version:  # links came, went, ended or wait for room: keep the selector in step
            wanted = links.watch()
            for fd, entry in list(watched.items()):
                want = wanted.get(fd)
                if want is None or want[0] is not entry[0]:  # (a closed link's number may be a new one's already)
                    selector.unregister(fd)
                    del watched[fd]
                elif want[1] != entry[1]:
                    selector.modify(want[0], want[1])
                    watched[fd] = want
            for fd, want in wanted.items():
                if fd not in watched:
                    selector.register(want[0], want[1])
                    watched[fd] = want
            version = links.version
        # No read or write on a link ever waits: the select wakes up for the links' deadlines instead.
        executor = server.executor
        issuing = executor.issuing()
        spinning = links.spinning()
        blocking = not (links.resuming or issuing or spinning)
        if blocking:
            links.rest_rings()  # (clients ring from now on; a batch that came meanwhile resumes its ring)
        events = selector.select(links.timeout() if blocking else 0)
        if blocking:
            links.wake_rings()
        else:
            links.look_at_rings()  # (their clients ring no doorbell while this loop goes on without blocking)
        if spinning and not events:
            # Polling for a link's next frame (a device-time segment stays open, as in a ring's spin: the turn is
            # uncontended).
            os.sched_yield()  # a polite spin: whatever else wants this CPU runs
        elif issuing and not events and not links.resuming:
            # Nothing to read and no ring to go back to: the host goes idle now, which must not count as device
            # time. (Only now, not at every batch end: see _cuda_timing.)
            executor.idle()
        for key, mask in events:
            if key.fd == front:
                code = _serve_front(sock, server)
                if code == 0:
                    return 0
            else:
                code = None
                if mask & selectors.EVENT_WRITE:
                    links.writable(key.fd)
                if mask & selectors.EVENT_READ:
                    links.readable(key.fd)
            if code is not None or server.fatal:
                log.error("fatal device error; exiting so the tenant gets a fresh context")
                return EXIT_FATAL
            if version != links.version:
                break  # the selector's other events may name a link that is gone
        links.expire()
        if links.resuming:  # rings cut off by their time slice, after everything else had its look
            links.resume()
            if server.fatal:
                log.error("fatal device error; exiting so the tenant gets a fresh context")
                return EXIT_FATAL


def main(argv: list[str] | None = None,
         on_device_open: Callable[[int | None, str], None] | None = None) -> int:
    """The worker: open the device, answer the front's first request with its description, then serve.
    ``on_device_open`` runs once the device is open, before anything of a tenant's (the sandbox's last layer), with
    the fd channel's number (the one socket descriptors may come from) and the device's backend ("cuda", "opencl")."""
    parser = argparse.ArgumentParser(prog="gpubroker-worker")
    parser.add_argument("--fd", type=int)
    parser.add_argument("--fd-channel", type=int, help="socket on which the front passes segment fds")
    parser.add_argument("--list", action="store_true", help="print the backend's devices as JSON and exit")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--tenant", default="")
    args = parser.parse_args(argv)
    from gpubroker.broker.logs import bind_log_context, configure_logging

    # The front's log format (text or JSON lines), each line tagged with the tenant.
    configure_logging(os.environ.get("GPUBROKER_LOG_FORMAT", "text"),
                      text_format=f"%(asctime)s worker[{args.tenant}] %(levelname)s %(message)s")
    bind_log_context(tenant=args.tenant)
    from gpubroker.broker.backends import detect_backend, list_devices, open_backend

    if args.list:
        kind = detect_backend() if args.backend == "auto" else args.backend
        try:
            devices = [asdict(d) for d in list_devices(kind)]
        except Exception as exc:
            print(json.dumps({"backend": kind, "error": f"{type(exc).__name__}: {exc}"}))
            return 1
        print(json.dumps({"backend": kind, "devices": devices}))
        return 0
    if args.fd is None:
        parser.error("--fd is required")
    sock = socket.socket(fileno=args.fd)

    try:
        backend = open_backend(args.backend, args.device)
        if on_device_open is not None:
            try:
                on_device_open(args.fd_channel, backend.device_info().backend)
            except (OSError, ImportError, RuntimeError) as exc:
                _reply(sock, 0, 1, Internal(f"the worker's sandbox could not refuse new sockets: {exc}").as_wire())
                return 2
        _reply(sock, 0, 0, asdict(backend.device_info()))  # (the front reads it as a DeviceInfoQuery's result)
    except GpuBrokerError as exc:
        _reply(sock, 0, 1, exc.as_wire())
        return 2
    except Exception as exc:
        _reply(sock, 0, 1, Internal(f"device init failed: {type(exc).__name__}: {exc}").as_wire())
        return 2
    server = WorkerServer(backend, args.tenant, args.device)
    # What exists now (the runtime, the device's bindings) lives as long as the worker: out of the collector's
    # sight, a full collection triggered while a large batch decodes no longer walks all of it.
    gc.freeze()
    if args.fd_channel is not None:
        server.segments.set_channel(socket.socket(fileno=args.fd_channel))
    code = serve(sock, server)
    if code == 0:
        backend.close()
    sys.stdout.flush()
    return code
