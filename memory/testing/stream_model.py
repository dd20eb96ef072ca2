"""A recording model of CUDA streams and events that fails on unordered conflicting accesses.

Every operation is issued on one stream (``"compute"``, or a copy stream per direction:
``"h2d"`` and ``"d2h"``, as a GPU's two copy engines) with the byte ranges of
device memory it reads and writes. Operations on one stream run in issue order; across streams
an operation is ordered after another only through events: ``record`` captures a stream's
position, ``wait_event`` makes a stream wait for it on the device, ``host_wait`` (event or
stream synchronisation) orders every later operation after it. Each operation carries a vector
clock (the last position of every stream it is known to follow), so "A happens before B" is
``B.clock[A.stream] >= A.position``.

When an operation is issued, every earlier operation on another stream that touches an
overlapping range, where at least one of the two writes, must happen before it; otherwise
:class:`StreamRace` is raised naming both operations. This is what a real GPU would do wrong:
a device-to-host copy reading a feature map before its producer kernel finished, or a prefetch
overwriting a block that a queued kernel still reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Op", "StreamEvent", "StreamModel", "StreamRace", "STREAMS"]

#: The streams of one device: kernels on ``compute``, transfers on ``h2d`` and ``d2h``.
STREAMS = ("compute", "h2d", "d2h")

Range = tuple[int, int]


class StreamRace(RuntimeError):
    """Two operations on different streams touch the same bytes with no event between them."""


@dataclass(frozen=True)
class Op:
    """One issued operation: its stream, position on it, clock, ranges and a description."""

    stream: str
    position: int
    clock: tuple[int, ...]
    reads: tuple[Range, ...]
    writes: tuple[Range, ...]
    what: str


@dataclass(frozen=True)
class StreamEvent:
    """A recorded event: the position of ``stream`` it stands for (and the clock there)."""

    stream: str
    clock: tuple[int, ...]


def _overlap(a: tuple[Range, ...], b: tuple[Range, ...]) -> bool:
    return any(s0 < e1 and s1 < e0 for s0, e0 in a for s1, e1 in b)


@dataclass
class StreamModel:
    """The ordering state of one device's streams; :meth:`issue` checks each new operation."""

    clocks: dict[str, list[int]] = field(
        default_factory=lambda: {s: [0] * len(STREAMS) for s in STREAMS})
    ops: dict[str, list[Op]] = field(default_factory=lambda: {s: [] for s in STREAMS})
    #: Number of operations issued (for tests: proof that the model saw the work).
    issued: int = 0
    #: The last position of every stream the host has waited for.
    host_clock: list[int] = field(default_factory=lambda: [0] * len(STREAMS))

    def _index(self, stream: str) -> int:
        try:
            return STREAMS.index(stream)
        except ValueError:
            raise ValueError(f"unknown stream {stream!r}; streams: {', '.join(STREAMS)}") from None

    def issue(self, stream: str, reads: tuple[Range, ...] = (), writes: tuple[Range, ...] = (),
              what: str = "") -> Op:
        """Issue an operation; :class:`StreamRace` if it conflicts with an unordered one."""
        k = self._index(stream)
        clock = self.clocks[stream]
        clock[k] += 1
        op = Op(stream, clock[k], tuple(clock), tuple(reads), tuple(writes), what)
        for other in STREAMS:
            if other == stream:
                continue
            j = self._index(other)
            known = clock[j]
            for prev in reversed(self.ops[other]):
                if prev.position <= known:
                    break  # this and all earlier ones on that stream happen before op
                if _overlap(prev.writes, op.reads + op.writes) or \
                        _overlap(prev.reads, op.writes):
                    raise StreamRace(
                        f"{op.what} on the {stream} stream touches bytes that {prev.what} on "
                        f"the {other} stream also uses, with no event ordering them")
        self.ops[stream].append(op)
        self.issued += 1
        return op

    def record(self, stream: str) -> StreamEvent:
        """An event at the current position of ``stream``."""
        return StreamEvent(stream, tuple(self.clocks[stream]))

    def wait_event(self, stream: str, event: StreamEvent) -> None:
        """``stream`` waits on the device for ``event``: later work on it follows the event."""
        clock = self.clocks[stream]
        for i, c in enumerate(event.clock):
            clock[i] = max(clock[i], c)

    def host_wait(self, event: StreamEvent) -> None:
        """The host waited for ``event``: everything issued afterwards, on any stream, follows."""
        for stream in STREAMS:
            self.wait_event(stream, event)
        self.host_clock[:] = [max(h, c) for h, c in zip(self.host_clock, event.clock)]

    def host_reached(self, event: StreamEvent) -> bool:
        """True when the host has already waited for ``event`` (or a later point of its
        stream): reading what it stands for needs no new wait. The model never completes work
        on its own: anything the host has not waited for is still running."""
        k = self._index(event.stream)
        return self.host_clock[k] >= event.clock[k]

    def synchronize(self) -> None:
        """The host waited for every stream."""
        for stream in STREAMS:
            self.host_wait(self.record(stream))

    def prune(self) -> None:
        """Forget operations that every stream is known to follow (bounded memory)."""
        for stream in STREAMS:
            k = self._index(stream)
            floor = min(self.clocks[s][k] for s in STREAMS)
            self.ops[stream] = [op for op in self.ops[stream] if op.position > floor]
