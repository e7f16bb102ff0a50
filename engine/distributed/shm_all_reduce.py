"""An all-reduce (sum) between the processes of one host through shared memory: each rank copies its partial
into its slot, signals, waits for the others, then sums every slot itself in rank order 0, 1, ..., N-1, so all
ranks hold bit-identical results, the same from run to run. It replaces gloo's loopback TCP for tensor
parallelism on CPU (a [1, 2048] bf16 all-reduce: ~435 us over gloo between two processes).

    owner (rank 0):  shm = ShmAllReduce.create(world_size, timeout_s=...)   # before spawning the other ranks
                     Process(target=worker, args=(shm.handle, ...))         # the handle rides in the args
    every rank:      comm = handle.open(rank); comm.all_reduce(tensor)      # in place, tensor back
                     comm.close();  owner: shm.close()                      # unlinks the segment

Layout of the segment (one cache line per flag: ranks store to their own lines only):

    | aborted (u8) | pid[r] (u64, one line each) | arrived[r] (u64, one line each) | buffer 0 | buffer 1 |
    buffer:  | slot 0 | slot 1 | ... | slot N-1 |     slot: slot_bytes, 64-byte aligned

A call moves its tensor in chunks of at most `slot_bytes`; chunk number g = 1, 2, ... (over the whole life of the
group) goes through buffer g % 2:

    rank r:  copy chunk into buffer[g % 2].slot[r]; arrived[r] = g; post every peer's semaphore
             wait until arrived[p] >= g for every p; sum slot 0..N-1 into the output chunk

Two buffers need one barrier per chunk, not two: a rank writes chunk g + 2 into the buffer chunk g used only
after it passed chunk g + 1's barrier, which every peer reaches only after it finished summing chunk g.

Waiting: a short spin on the flags (the peer is usually microseconds away in a decode step), then sleep on this
rank's semaphore (one per rank, of the `multiprocessing` context of semaphores handed to workers, made by the owner
before the ranks exist). The flags are the truth and the semaphore is only a wake-up: a rank checks the flags
before each sleep, and a peer posts after storing its flag, so no wake-up is lost; posts that find the rank awake
are drained after the barrier (sem_trywait: no system call), so the count stays bounded. Every 50 ms asleep a rank
checks that its peers live (their pids, and the `aborted` flag any rank or rank 0's watcher sets), so a dead peer
fails the others within a fraction of a second; a peer alive but absent fails them after `timeout_s`.

Memory ordering: the slot's stores must be visible before the flag that announces them, and a waiter must not
load a slot before it saw the flag. x86-64 keeps stores in order and loads in order, but AArch64 does not; a
lock's acquire and release are full barriers on every platform (as vLLM's shm_broadcast does), so each rank
passes one after copying its slot and after seeing the flags. Each flag is one aligned 8-byte word, stored and
loaded by one C call.

The all-gather (vocab-parallel logits: each rank's slice of the vocabulary) takes the same steps and copies the
slots out in rank order instead of summing them.

Sums: float16 and bfloat16 are summed in float32 and rounded once (as vLLM's CPU kernel does): N partials added
in bf16 would round N - 1 times. Other dtypes are summed in their own.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.synchronize import Semaphore
from pathlib import Path
from typing import Callable, Optional

import torch

from engine.distributed.worker_processes import semaphore_context
from engine.distributed.shm_segment import attach_segment, create_segment, segment_buffer

SEGMENT_PREFIX = "psar"  # + the owner's pid: what a test looks for in /dev/shm
_LINE = 64  # cache line
_SPIN_S = 50e-6
_CHECK_S = 0.05
"""How often a sleeping rank wakes to check that its peers live."""
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


class PeerGoneError(RuntimeError):
    """A peer of the all-reduce died, or a rank aborted the group: no collective can complete."""


@dataclass(frozen=True)
class _Layout:
    world_size: int
    slot_bytes: int

    @property
    def pids_offset(self) -> int:
        return _LINE

    @property
    def arrived_offset(self) -> int:
        return self.pids_offset + self.world_size * _LINE

    @property
    def buffers_offset(self) -> int:
        return self.arrived_offset + self.world_size * _LINE

    def slot_offset(self, buffer: int, rank: int) -> int:
        return self.buffers_offset + (buffer * self.world_size + rank) * self.slot_bytes

    @property
    def size(self) -> int:
        return self.slot_offset(2, 0)


@dataclass(frozen=True)
class AllReduceHandle:
    """What a rank needs to join: pass it in `multiprocessing` Process args, since its semaphores pickle
    only while a process is being started."""

    name: str
    world_size: int
    slot_bytes: int
    timeout_s: float
    wake: tuple[Semaphore, ...]

    def open(self, rank: int, spin_s: float = _SPIN_S) -> ShmAllReduce:
        return ShmAllReduce(self, rank, spin_s)


class ShmAllReduceOwner:
    """Rank 0's ownership of the segment: `create` it before the ranks start, `close` unlinks it."""

    def __init__(self, segment: shared_memory.SharedMemory, handle: AllReduceHandle):
        self.handle = handle
        self._segment: Optional[shared_memory.SharedMemory] = segment
        self._lock = threading.Lock()  # abort comes from rank 0's watcher thread, close from the engine's

    def abort(self) -> None:
        """Make every rank's current and next collective raise (a worker died: fail fast, not after timeout)."""
        with self._lock:
            if self._segment is not None:
                segment_buffer(self._segment)[0] = 1

    def close(self) -> None:
        """Abort and unlink; idempotent. Ranks still attached keep their mapping until they close."""
        with self._lock:
            segment, self._segment = self._segment, None
            if segment is not None:
                segment_buffer(segment)[0] = 1
                segment.close()
                segment.unlink()

    def __enter__(self) -> ShmAllReduceOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_segment", None) is not None and hasattr(self, "_lock"):
            self.close()


class ShmAllReduce:
    """Rank `rank`'s end of the group; `all_reduce` must be called by every rank in the same order with tensors of
    the same shape and dtype (as torch.distributed's collectives)."""

    @staticmethod
    def create(world_size: int, *, slot_bytes: int = 1 << 20, timeout_s: float = 60.0) -> ShmAllReduceOwner:
        if world_size < 2 or slot_bytes < _LINE:
            raise ValueError(f"need world_size >= 2 and slot_bytes >= {_LINE}")
        slot_bytes = -(-slot_bytes // _LINE) * _LINE
        layout = _Layout(world_size, slot_bytes)
        segment = create_segment(SEGMENT_PREFIX, layout.size)
        try:
            segment_buffer(segment)[: layout.buffers_offset] = bytes(layout.buffers_offset)  # not aborted, no arrival
            context = semaphore_context()
            wake = tuple(context.Semaphore(0) for _ in range(world_size))
            return ShmAllReduceOwner(segment, AllReduceHandle(segment.name, world_size, slot_bytes, timeout_s, wake))
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    def __init__(self, handle: AllReduceHandle, rank: int, spin_s: float = _SPIN_S):
        if not 0 <= rank < handle.world_size:
            raise ValueError(f"rank {rank} outside 0..{handle.world_size - 1}")
        self.rank = rank
        self.world_size = handle.world_size
        self.timeout_s = handle.timeout_s
        self.spin_s = spin_s
        self._layout = _Layout(handle.world_size, handle.slot_bytes)
        self._wake = handle.wake
        self._segment: Optional[shared_memory.SharedMemory] = attach_segment(handle.name)
        buf = segment_buffer(self._segment)
        self._aborted = buf[0:1]
        self._pids = buf[self._layout.pids_offset : self._layout.arrived_offset].cast("Q")
        self._arrived = buf[self._layout.arrived_offset : self._layout.buffers_offset].cast("Q")
        self._bytes = torch.frombuffer(buf, dtype=torch.uint8)  # every slot is a view of this
        self._stride = _LINE // 8  # one flag per cache line, in u64 units
        self._generation = self._arrived[rank * self._stride]  # 0 when new; a re-opened rank resumes
        self._fence_lock = threading.Lock()
        self._scratch: Optional[torch.Tensor] = None
        self._broken: Optional[BaseException] = None
        self._pids[rank * self._stride] = os.getpid()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor`, in place (a contiguous CPU tensor; others go through a copy)."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        self._exchange(flat, lambda chunk, slots, start: self._sum_into(chunk, slots))
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape and dtype on every rank), stacked in rank order: a new
        [world_size, *tensor.shape] tensor, the same on every rank."""
        flat = tensor.reshape(-1)
        out = torch.empty((self.world_size, flat.numel()), dtype=tensor.dtype)

        def take(chunk: torch.Tensor, slots: list[torch.Tensor], start: int) -> None:
            for rank, slot in enumerate(slots):
                out[rank, start : start + chunk.numel()].copy_(slot)

        self._exchange(flat, take)
        return out.view(self.world_size, *tensor.shape)

    def _exchange(self, flat: torch.Tensor, combine: Callable[[torch.Tensor, list[torch.Tensor], int], None]) -> None:
        """Pass `flat` through the slots in chunks; `combine(chunk, every rank's slot, offset)` reads each chunk's
        slots before the next chunk is exchanged (what lets two buffers take one barrier per chunk)."""
        if self._broken is not None:
            raise PeerGoneError(f"shared-memory all-reduce: unusable after {self._broken}")
        if self._segment is None:
            raise PeerGoneError("shared-memory all-reduce: closed")
        step = self._layout.slot_bytes // flat.element_size()
        try:
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step]
                combine(chunk, self._arrive(chunk), start)
                while self._wake[self.rank].acquire(block=False):  # posts that found this rank awake
                    pass
        except BaseException as error:
            self._broken = error
            self._aborted[0] = 1  # the peers fail now instead of after their timeout
            raise

    def _arrive(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Copy `chunk` into this rank's slot, wait for every peer's; their slots, in rank order."""
        generation = self._generation + 1
        buffer = generation % 2
        self._slot(buffer, self.rank, chunk).copy_(chunk)
        self._fence()  # the slot's stores before the flag's
        self._arrived[self.rank * self._stride] = generation
        self._generation = generation
        for peer, wake in enumerate(self._wake):
            if peer != self.rank:
                wake.release()
        self._wait_for_peers(generation)
        self._fence()  # the peers' slots are loaded only after their flags
        return [self._slot(buffer, rank, chunk) for rank in range(self.world_size)]

    def _slot(self, buffer: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = self._layout.slot_offset(buffer, rank)
        nbytes = like.numel() * like.element_size()
        return self._bytes[start : start + nbytes].view(like.dtype)

    def _sum_into(self, out: torch.Tensor, slots: list[torch.Tensor]) -> None:
        """out = slot 0 + slot 1 + ... in that order (the same rounding on every rank)."""
        wide = _WIDEN.get(out.dtype)
        if wide is None:
            torch.add(slots[0], slots[1], out=out)
            for slot in slots[2:]:
                out.add_(slot)
            return
        if self._scratch is None or self._scratch.dtype != wide or self._scratch.numel() < out.numel():
            self._scratch = torch.empty(self._layout.slot_bytes // out.element_size(), dtype=wide)
        acc = self._scratch[: out.numel()]
        acc.copy_(slots[0])
        for slot in slots[1:]:
            acc.add_(slot)
        out.copy_(acc)

    def _wait_for_peers(self, generation: int) -> None:
        if self._all_arrived(generation):
            return
        deadline = time.perf_counter() + self.spin_s
        while time.perf_counter() < deadline:
            if self._all_arrived(generation):
                return
        give_up = time.monotonic() + self.timeout_s
        wake = self._wake[self.rank]
        while True:
            # liveness before arrival: a peer may arrive, finish this chunk and exit while this rank is
            # descheduled; its part is here, so the chunk completes (the next one fails). A peer seen gone
            # before the arrivals are read cannot arrive after them.
            gone = self._gone_peer()
            if self._all_arrived(generation):
                return
            if gone is not None:
                raise PeerGoneError(gone)
            left = give_up - time.monotonic()
            if left <= 0:
                late = [p for p in range(self.world_size) if self._arrived[p * self._stride] < generation]
                raise TimeoutError(
                    f"shared-memory all-reduce: rank(s) {late} of {self.world_size} did not arrive within "
                    f"{self.timeout_s:.3g} s (rank {self.rank} waiting): a rank is stuck"
                )
            wake.acquire(timeout=min(_CHECK_S, left))

    def _all_arrived(self, generation: int) -> bool:
        arrived, stride = self._arrived, self._stride
        return all(arrived[p * stride] >= generation for p in range(self.world_size))

    def _gone_peer(self) -> Optional[str]:
        """Why the group cannot complete another chunk (aborted, or a peer's process is gone), or None."""
        if self._aborted[0]:
            return "shared-memory all-reduce: the group was aborted (a rank failed or is stopping)"
        for peer in range(self.world_size):
            pid = self._pids[peer * self._stride]
            if peer != self.rank and pid and not _alive(pid):
                return f"shared-memory all-reduce: rank {peer} (pid {pid}) is gone"
        return None

    def _fence(self) -> None:
        with self._fence_lock:
            pass

    def close(self) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        del self._bytes
        self._scratch = None
        for view in (self._aborted, self._pids, self._arrived):
            view.release()
        segment.close()

    def __del__(self) -> None:
        if getattr(self, "_segment", None) is not None:
            self.close()


def _alive(pid: int) -> bool:
    """False once `pid` has exited, zombie included (a killed child stays one until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists
    return state not in ("Z", "X")
