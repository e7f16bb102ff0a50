"""A one-writer, many-reader broadcast queue over a shared-memory ring: each step's message goes once from rank 0
(the engine process) to every worker process of the host, pickled once, read in place by all.

    writer:  queue = ShmBroadcastQueue.create(num_readers=3)     # before spawning the workers
             Process(target=worker, args=(queue.handle, k))     # the handle rides in the args
             queue.enqueue(step) ... queue.close()
    reader:  reader = handle.open(k); step = reader.dequeue(timeout=...)   # BroadcastClosed after close()

Layout of the shared memory (message `seq` = 1, 2, ... lives in slot (seq - 1) % num_slots):

    | closed | written[num_slots] (u64) | read[num_slots][num_readers] (u8) | slot 0 | slot 1 | ... |
    slot:    | kind (u8), name length (u32), pickle length (u64) | the pickle, or an overflow segment's name |

`written[s]` is the seq of the message slot s holds; `read[s][k]` turns 1 once reader k is done with it. A
pickle larger than a slot goes into a segment of its own, named in the slot and unlinked by the writer once
every reader has read it (or at close).

Waiting sleeps (the host's cores are the workers'): per reader k, two semaphores of the `multiprocessing` context
of the semaphores handed to workers (distributed/worker_processes.py), made before the readers exist and passed to
them in the handle:

    data[k]     posted by the writer once per message (and once at close); taken by reader k once per dequeue
    credits[k]  starts at num_slots; taken by the writer once per message, given back by reader k after each
                dequeue: the writer waits only when reader k is a whole ring behind, and names it on timeout

A reader may first poll `written` for a few microseconds (`spin_s`), which saves the wake-up of a sleeping
process when the next message is that close, then sleeps on `data[k]`.

Memory ordering. POSIX makes sem_post and sem_wait points of memory synchronization (XBD 4.12): what a process
stored before a post is visible to the process whose wait that post satisfied, on any architecture (x86-64's
TSO and AArch64's weaker model alike; glibc issues the barriers). Both hand-overs go through one:
  - the writer stores the payload, the slot header and `written[s]`, then posts `data[k]`; reader k loads
    none of them (beyond polling `written[s]` as a hint) before its wait on `data[k]` returns;
  - reader k finishes with the payload (unpickled, overflow segment closed), stores `read[s][k]`, then posts
    `credits[k]`; the writer stores nothing in slot s before it has taken a credit from every reader for it.
So the flags need no fence of their own: a stale `written` seen while polling costs only a wake-up, a stale
`read` only delays an overflow segment's unlink. From CPython we rely on each access to the shared memory
being one C call (memoryview item or slice, `pickle.loads` over a view) executed in program order, and on each
flag being one byte or one aligned 8-byte word. vLLM's `shm_broadcast` polls plain flags and orders them with a
lock acquire/release as a fence; the semaphores here give the ordering and the sleeping at once.
"""

from __future__ import annotations

import pickle
import struct
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.synchronize import Semaphore
from typing import Optional

from engine.distributed.worker_processes import semaphore_context
from engine.distributed.shm_segment import attach_segment, create_segment, segment_buffer

SEGMENT_PREFIX = "psb"  # + the writer's pid: what a test looks for in /dev/shm
_HEADER = struct.Struct("<B3xIQ")  # kind, overflow name length, pickle length
_INLINE, _OVERFLOW = 1, 2
_ALIGN = 64  # slots start on cache lines


class BroadcastClosed(EOFError):
    """The writer closed the queue: no message will follow."""


@dataclass(frozen=True)
class _Layout:
    """Offsets into the ring's segment."""

    num_readers: int
    num_slots: int
    slot_bytes: int

    @property
    def written_offset(self) -> int:
        return 8

    @property
    def read_offset(self) -> int:
        return self.written_offset + 8 * self.num_slots

    @property
    def slots_offset(self) -> int:
        end = self.read_offset + self.num_slots * self.num_readers
        return -(-end // _ALIGN) * _ALIGN

    @property
    def size(self) -> int:
        return self.slots_offset + self.num_slots * self.slot_bytes

    @property
    def capacity(self) -> int:
        """The largest pickle a slot holds inline."""
        return self.slot_bytes - _HEADER.size


class _Ring:
    """Views of the ring's segment, shared by both ends; `release()` before closing the segment."""

    def __init__(self, segment: shared_memory.SharedMemory, layout: _Layout):
        self.segment = segment
        self.layout = layout
        buf = segment_buffer(segment)
        self.closed = buf[0:1]
        self.written = buf[layout.written_offset : layout.read_offset].cast("Q")
        self.read = buf[layout.read_offset : layout.read_offset + layout.num_slots * layout.num_readers]
        self.slots = buf[layout.slots_offset : layout.size]

    def slot(self, index: int) -> memoryview:
        start = index * self.layout.slot_bytes
        return self.slots[start : start + self.layout.slot_bytes]

    def read_flags(self, index: int) -> bytes:
        start = index * self.layout.num_readers
        return bytes(self.read[start : start + self.layout.num_readers])

    def release(self) -> None:
        for view in (self.closed, self.written, self.read, self.slots):
            view.release()
        self.segment.close()


@dataclass(frozen=True)
class BroadcastHandle:
    """What a reader needs to open the queue: pass it to `multiprocessing` Process args, since its
    semaphores pickle only while a process is being started."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int
    data: tuple[Semaphore, ...]
    credits: tuple[Semaphore, ...]

    def open(self, reader_index: int, spin_s: float = 0.0) -> ShmBroadcastReader:
        return ShmBroadcastReader(self, reader_index, spin_s)


class ShmBroadcastQueue:
    """The writer's end: `create` it, hand `handle` to the readers, `enqueue` messages, `close` it."""

    def __init__(self, segment: shared_memory.SharedMemory, handle: BroadcastHandle, enqueue_timeout_s: float):
        self.handle = handle
        self.enqueue_timeout_s = enqueue_timeout_s
        self._layout = _Layout(handle.num_readers, handle.num_slots, handle.slot_bytes)
        self._ring: Optional[_Ring] = _Ring(segment, self._layout)
        self._next_seq = 1
        self._overflow: dict[int, shared_memory.SharedMemory] = {}  # slot -> its message's segment

    @classmethod
    def create(
        cls, num_readers: int, *, slot_bytes: int = 1 << 20, num_slots: int = 8, enqueue_timeout_s: float = 60.0
    ) -> ShmBroadcastQueue:
        if num_readers < 1 or num_slots < 1 or slot_bytes <= _HEADER.size:
            raise ValueError(f"need num_readers >= 1, num_slots >= 1, slot_bytes > {_HEADER.size}")
        layout = _Layout(num_readers, num_slots, slot_bytes)
        segment = create_segment(SEGMENT_PREFIX, layout.size)
        try:
            segment_buffer(segment)[: layout.slots_offset] = bytes(layout.slots_offset)  # no flag set, not closed
            context = semaphore_context()
            handle = BroadcastHandle(
                name=segment.name,
                num_readers=num_readers,
                num_slots=num_slots,
                slot_bytes=slot_bytes,
                data=tuple(context.Semaphore(0) for _ in range(num_readers)),
                credits=tuple(context.Semaphore(num_slots) for _ in range(num_readers)),
            )
            return cls(segment, handle, enqueue_timeout_s)
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    def enqueue(self, obj: object, timeout: Optional[float] = None) -> None:
        """Publish `obj` to every reader. Waits while a reader is a whole ring behind; TimeoutError (naming
        the readers) after `timeout` (default `enqueue_timeout_s`), with the queue left as it was."""
        ring = self._open_ring()
        payload = pickle.dumps(obj, protocol=5)  # before taking any slot: an unpicklable obj changes nothing
        seq = self._next_seq
        index = (seq - 1) % self._layout.num_slots
        self._take_credits(seq, self.enqueue_timeout_s if timeout is None else timeout)
        self._unlink_overflow(index)  # every reader has read the message it held: we hold their credits
        try:
            self._write_slot(ring, index, payload)
        except BaseException:  # e.g. no room in /dev/shm for an overflow segment: the slot stays free
            for semaphore in self.handle.credits:
                semaphore.release()
            raise
        start = index * self._layout.num_readers
        ring.read[start : start + self._layout.num_readers] = bytes(self._layout.num_readers)
        ring.written[index] = seq
        self._next_seq = seq + 1
        for semaphore in self.handle.data:  # after every store above: the post publishes them (see top)
            semaphore.release()
        self._unlink_read_overflow()

    def _write_slot(self, ring: _Ring, index: int, payload: bytes) -> None:
        with ring.slot(index) as slot:  # released at once: no view may outlive the segment's close
            if len(payload) <= self._layout.capacity:
                _HEADER.pack_into(slot, 0, _INLINE, 0, len(payload))
                slot[_HEADER.size : _HEADER.size + len(payload)] = payload
            else:
                name = self._write_overflow(index, payload)
                _HEADER.pack_into(slot, 0, _OVERFLOW, len(name), len(payload))
                slot[_HEADER.size : _HEADER.size + len(name)] = name

    def close(self, timeout: float = 1.0) -> None:
        """Tell the readers and unlink the shared memory; idempotent. A reader gets every message enqueued
        before, then BroadcastClosed: those in the ring always (its mapping outlives the unlink), a message
        in an overflow segment if read within `timeout`, which close waits for (polling: rare, and at the end)."""
        ring = self._ring
        if ring is None:
            return
        try:
            ring.closed[0] = 1
            for semaphore in self.handle.data:
                semaphore.release()
            deadline = time.monotonic() + timeout
            while self._overflow and time.monotonic() < deadline:
                time.sleep(0.001)
                self._unlink_read_overflow()
        finally:
            self._ring = None
            for index in list(self._overflow):
                self._unlink_overflow(index)
            ring.release()
            ring.segment.unlink()

    def __enter__(self) -> ShmBroadcastQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_ring", None) is not None:
            self.close(timeout=0)  # dropped without close(): unlink, wait for no one

    @property
    def closed(self) -> bool:
        return self._ring is None

    def _open_ring(self) -> _Ring:
        if self._ring is None:
            raise BroadcastClosed("the broadcast queue is closed")
        return self._ring

    def _take_credits(self, seq: int, timeout: float) -> None:
        """One credit from every reader for `seq`'s slot; on timeout, give back those taken and raise."""
        taken = [semaphore.acquire(block=False) for semaphore in self.handle.credits]
        if all(taken):
            return
        deadline = time.monotonic() + timeout
        for k, semaphore in enumerate(self.handle.credits):
            if not taken[k]:
                taken[k] = semaphore.acquire(timeout=max(0.0, deadline - time.monotonic()))
        if all(taken):
            return
        for k, semaphore in enumerate(self.handle.credits):
            if taken[k]:
                semaphore.release()
        lagging = [k for k, ok in enumerate(taken) if not ok]
        raise TimeoutError(
            f"shared-memory broadcast: reader(s) {lagging} of {self.handle.num_readers} have not read message "
            f"{seq - self._layout.num_slots} after {timeout:.3g} s, and the ring ({self._layout.num_slots} "
            f"slots) is full: a worker is stuck or dead"
        )

    def _write_overflow(self, index: int, payload: bytes) -> bytes:
        segment = create_segment(SEGMENT_PREFIX, len(payload))
        self._overflow[index] = segment
        segment_buffer(segment)[: len(payload)] = payload
        return segment.name.encode()

    def _unlink_overflow(self, index: int) -> None:
        segment = self._overflow.pop(index, None)
        if segment is not None:
            segment.close()
            segment.unlink()

    def _unlink_read_overflow(self) -> None:
        """Unlink the overflow segments every reader is done with, without waiting for their slots' reuse."""
        ring = self._ring
        if ring is None or not self._overflow:
            return
        everyone = b"\x01" * self._layout.num_readers
        for index in [i for i in self._overflow if ring.read_flags(i) == everyone]:
            self._unlink_overflow(index)


class ShmBroadcastReader:
    """Reader k's end: `dequeue` returns every message in order; BroadcastClosed once the writer has closed."""

    def __init__(self, handle: BroadcastHandle, reader_index: int, spin_s: float = 0.0):
        if not 0 <= reader_index < handle.num_readers:
            raise ValueError(f"reader_index {reader_index} outside 0..{handle.num_readers - 1}")
        self.reader_index = reader_index
        self.spin_s = spin_s
        self._handle = handle
        self._layout = _Layout(handle.num_readers, handle.num_slots, handle.slot_bytes)
        self._ring: Optional[_Ring] = _Ring(attach_segment(handle.name), self._layout)
        self._data = handle.data[reader_index]
        self._credit = handle.credits[reader_index]
        self._next_seq = 1
        self._closed = False

    def dequeue(self, timeout: Optional[float] = None) -> object:
        """The next message; TimeoutError when none comes within `timeout` seconds (None: wait for ever)."""
        ring = self._ring
        if self._closed or ring is None:
            raise BroadcastClosed("the broadcast queue is closed")
        seq = self._next_seq
        index = (seq - 1) % self._layout.num_slots
        if self.spin_s > 0:
            self._poll(ring, index, seq)
        if not self._data.acquire(timeout=timeout):
            raise TimeoutError(
                f"shared-memory broadcast: reader {self.reader_index} got no message {seq} within {timeout} s: "
                f"the writer is stuck or dead"
            )
        if ring.written[index] != seq:
            if ring.closed[0]:
                self._closed = True
                raise BroadcastClosed("the broadcast queue is closed")
            raise RuntimeError(f"shared-memory broadcast: slot {index} holds message {ring.written[index]}, not {seq}")
        with ring.slot(index) as slot:
            obj = self._load(slot)
        ring.read[index * self._layout.num_readers + self.reader_index] = 1
        self._next_seq = seq + 1
        self._credit.release()  # after every load and the flag: the post orders them (see top)
        return obj

    def close(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.release()

    def __enter__(self) -> ShmBroadcastReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_ring", None) is not None:
            self.close()  # the views first: the segment refuses to close under them

    def _poll(self, ring: _Ring, index: int, seq: int) -> None:
        """Watch `written` for up to spin_s: a message this close is cheaper to catch awake than to be woken for."""
        deadline = time.perf_counter() + self.spin_s
        while ring.written[index] != seq and not ring.closed[0] and time.perf_counter() < deadline:
            pass

    def _load(self, slot: memoryview) -> object:
        kind, name_length, length = _HEADER.unpack_from(slot, 0)
        if kind == _INLINE:
            with slot[_HEADER.size : _HEADER.size + length] as payload:
                return pickle.loads(payload)
        name = bytes(slot[_HEADER.size : _HEADER.size + name_length]).decode()
        try:
            segment = attach_segment(name)
        except FileNotFoundError:
            if self._ring is not None and self._ring.closed[0]:  # close() unlinked what was left unread
                self._closed = True
                raise BroadcastClosed("the broadcast queue is closed") from None
            raise
        try:
            with segment_buffer(segment)[:length] as payload:
                return pickle.loads(payload)
        finally:
            segment.close()
