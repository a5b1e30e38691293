"""A shared memory arena: one anonymous memory file (memfd), mapped by two processes, written by one.

The writer allocates a block, writes an array into it and sends the block's offset over the
socket; the reader maps the same file (its descriptor came over the socket with SCM_RIGHTS)
and reads the array in place. The writer frees the block once the reader says it is done.

A memfd rather than `multiprocessing.shared_memory`: it has no name, so a process killed
with SIGKILL leaks nothing in /dev/shm (the memory goes with the last descriptor), no
resource-tracker process is needed per worker, and Docker's 64 MB /dev/shm does not bound it.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading

# Blocks start on a cache line: numpy reads them in place, and two writers never share a line.
ALIGNMENT = 64


class Arena:
    """A mapped memory file; `allocate` and `free` serve its one writer (thread-safe)."""

    def __init__(self, fd: int, *, keep_descriptor: bool = False) -> None:
        self.size = os.fstat(fd).st_size
        self.memory = mmap.mmap(fd, self.size)
        # The mapping holds the memory; the descriptor is kept only until it is sent to the peer,
        # so that nothing but live mappings (and the arrays that read them) keeps an arena alive.
        self.fd: int | None = fd
        if not keep_descriptor:
            self.drop_descriptor()
        self.buffer = memoryview(self.memory)
        self._lock = threading.Lock()
        # Free blocks as sorted (offset, size); allocated blocks by offset.
        self._free: list[tuple[int, int]] = [(0, self.size)]
        self._used: dict[int, int] = {}

    @classmethod
    def create(cls, size: int, name: str = "model-server-arena") -> Arena:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, keep_descriptor=True)

    @property
    def descriptor(self) -> int:
        if self.fd is None:
            raise ValueError("this arena's descriptor was sent and dropped")
        return self.fd

    def drop_descriptor(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a free block of at least `nbytes`, or None when none is free (first fit)."""
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            for index, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + size, free - size)
                    self._used[offset] = size
                    return offset
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                return  # freed twice (a reply after a reconnect): nothing to do
            index = bisect.bisect(self._free, (offset, size))
            # Join the neighbours, so that large blocks come back after small ones are freed.
            if index < len(self._free) and self._free[index][0] == offset + size:
                size += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == offset:
                offset, before = self._free.pop(index - 1)
                size += before
                index -= 1
            self._free.insert(index, (offset, size))

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def close(self) -> None:
        try:
            self.buffer.release()
            self.memory.close()
        except BufferError:
            pass  # an array still reads from it; the mapping goes when that array does
        self.drop_descriptor()
