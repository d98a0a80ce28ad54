"""The front, the workers' zygote and each launcher it forks: typed messages on Unix SOCK_SEQPACKET sockets.

A sandboxed worker's start used to be two fresh Pythons in a row: the sandbox's launcher, then (exec'd inside the
sandbox) the worker, which imported NumPy, the backend's runtime and the worker's code before it opened its device:
most of a first session's second. The zygote (``broker/zygote``) is one process per broker, started with the front,
that has imported all of that once and forks a launcher for each worker; the launcher builds the sandbox as before
and, instead of exec'ing a new Python, runs the worker already loaded (``broker/sandbox/_launch.py``).

Each message is one packet (its boundaries kept by the socket), a msgspec Struct tagged like the acceptor's
(``wire/accept.py``), with the descriptors it names attached (SCM_RIGHTS):

- front -> zygote, on their socketpair: ``Fork`` (attached: the launcher's end of a socketpair of its own): fork
  one launcher, which reads its instructions on that socket. The zygote never sees a tenant's name, spec or
  descriptors: a forked launcher (and so the worker) inherits the zygote's memory, which holds nothing of
  another tenant's.
- zygote -> front: ``Ready`` (first: it has loaded everything and runs single-threaded, so its children may
  unshare a user namespace), ``Forked`` (the launcher's pid, its pidfd attached: the front signals it by that,
  never by a pid that may have been reused), ``ForkFailed`` (that fork could not be made: the system refused it;
  the zygote serves on), ``Exited`` (a launcher ended: its exit code as Popen gives one,
  negative for a signal; the zygote is its parent and reaps it).
- front -> launcher, on the launcher's own socket: ``Launch`` (attached: its stdout's and stderr's pipes, then the
  descriptors ``fds`` names, which the launcher puts at those numbers): the argv the front would have exec'd (the
  launcher's, whose spec and worker argv it runs, and which becomes its command line).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from gpubroker.wire import encoding

__all__ = ["MAX_LAUNCH_MESSAGE", "MAX_ZYGOTE_MESSAGE", "Exited", "Fork", "ForkFailed", "Forked", "FromZygote", "Launch",
           "Ready", "decode_from_zygote", "decode_launch", "decode_to_zygote", "encode"]

MAX_ZYGOTE_MESSAGE: Final = 256  # either way: a Fork, a pid and an exit code, or a fork's failure
MAX_LAUNCH_MESSAGE: Final = 256 * 1024  # a launcher's argv: its spec (the binds, the limits) and the worker's argv

Pid = Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
Fd = Annotated[int, msgspec.Meta(ge=3, lt=1 << 20)]


class Fork(msgspec.Struct, array_like=True, tag="fork", tag_field="op", frozen=True):
    """Fork one launcher; its socket (attached) brings it a ``Launch``."""


class _FromZygote(msgspec.Struct, array_like=True, tag_field="op", frozen=True):
    pass


class Ready(_FromZygote, tag="ready", frozen=True):
    """The zygote's first message: loaded (in ``seconds``), single-threaded, taking ``Fork``s."""

    pid: Pid
    seconds: Annotated[float, msgspec.Meta(ge=0.0)]


class Forked(_FromZygote, tag="forked", frozen=True):
    """The launcher forked for the oldest ``Fork`` not yet answered (its pidfd attached)."""

    pid: Pid


class ForkFailed(_FromZygote, tag="fork_failed", frozen=True):
    """The oldest ``Fork`` not yet answered could not be made (``reason``: the system's, such as EAGAIN past a
    task limit); the zygote serves on."""

    reason: Annotated[str, msgspec.Meta(max_length=160)]


class Exited(_FromZygote, tag="exited", frozen=True):
    """Launcher ``pid`` ended: ``code`` as subprocess gives one (the exit status, or minus the signal)."""

    pid: Pid
    code: Annotated[int, msgspec.Meta(ge=-128, le=255)]


FromZygote = Ready | Forked | ForkFailed | Exited


class Launch(msgspec.Struct, array_like=True, tag="launch", tag_field="op", frozen=True):
    """What a forked launcher runs: ``argv``, the launcher's command line as the front would exec it (``python -m
    gpubroker.broker.sandbox --spec JSON -- WORKER ARGV``). Attached: stdout's pipe, stderr's pipe, then one
    descriptor for each of ``fds``, the number it must have (the spec and the worker's argv name them)."""

    argv: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_LAUNCH_MESSAGE)]], msgspec.Meta(max_length=256)]
    fds: Annotated[list[Fd], msgspec.Meta(max_length=16)]


encode: Final = encoding.encode

_to_zygote: msgspec.msgpack.Decoder[Fork] = msgspec.msgpack.Decoder(Fork)
_from_zygote: msgspec.msgpack.Decoder[Ready | Forked | ForkFailed | Exited] = msgspec.msgpack.Decoder(FromZygote)
_launch: msgspec.msgpack.Decoder[Launch] = msgspec.msgpack.Decoder(Launch)


def decode_to_zygote(payload: bytes) -> Fork:
    """A message of the front (msgspec's errors raised as they are: the zygote exits on one, a bug)."""
    return _to_zygote.decode(payload)


def decode_from_zygote(payload: bytes) -> Ready | Forked | ForkFailed | Exited:
    """A message of the zygote; raises ValueError (msgspec's DecodeError or ValidationError) on any other bytes."""
    return _from_zygote.decode(payload)


def decode_launch(payload: bytes) -> Launch:
    """The front's instructions to a forked launcher (msgspec's errors raised as they are: it exits on one)."""
    return _launch.decode(payload)
