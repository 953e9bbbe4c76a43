"""Write array bytes to known offsets of an open file from a background thread, while the training step goes on.

HDF5 (through h5py) holds the GIL while it writes, so a step that hands it every tensor waits for each write.
A capture instead creates each dataset with its storage allocated at once (contiguous, no fill), learns its
offset in the file, and hands the bytes here: they are copied into a ring buffer (a ``memcpy``: the step may
change its tensors in place afterwards, an optimizer its weights), and a thread writes them with
``os.pwrite``, which releases the GIL, and hashes the ones kept as a digest (``hashlib`` releases it too) into
the 32 bytes the caller gives (a row of the step's digest table, written when the step is committed).
Memory: the ring, whatever the step.  An array goes through the ring in slices of at most :data:`SLICE_BYTES`
(a digest hashed slice by slice), so that the caller waits for room for one slice, never for the ``pwrite`` of a
whole array: an array larger than the ring too (a captured ResNet-18 step spent 0.3 s of its own thread in the
``pwrite`` of its 9 MB weights and gradients when those were written by the caller).  A small array
(:data:`INLINE_BYTES`) is written by the caller, gathered with the small arrays that follow it in the file into
one ``pwrite`` (HDF5 allocates a step's small datasets mostly one after the other: a MobileNetV2 step's 1,100
arrays took as many ``pwrite`` calls).  :meth:`BackgroundWrites.wait` returns when
everything handed over is in the file (before HDF5 reads, frees or flushes anything), and raises the thread's
error, if any.
"""
import hashlib
import threading
from collections import deque

import numpy as np

from qgcli.storage.hdf5.small import pwrite_all

#: Bytes of the ring buffer the writes wait in (allocated at the first write).
RING_BYTES = 8 << 20
#: Arrays smaller than this are written by the caller at once: handing them to the thread costs more.
INLINE_BYTES = 64 << 10
#: The largest piece of an array copied into the ring in one go (an eighth of the ring).
SLICE_BYTES = RING_BYTES // 8
#: The most bytes of adjacent small arrays gathered for one ``pwrite`` by the caller.
GATHER_BYTES = 256 << 10


def sha256(data):
    """The SHA-256 of ``data``'s bytes, as 32 ``uint8`` (what a digest dataset holds)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(hashlib.sha256(memoryview(raw)).digest(), dtype=np.uint8)


class BackgroundWrites:
    """The writes of one file descriptor, in order, on one thread."""

    def __init__(self, fd, capacity=RING_BYTES, inline_below=INLINE_BYTES, slice_bytes=None):
        self.fd = fd
        self.capacity = capacity
        self.inline_below = inline_below
        self.slice_bytes = max(1, min(capacity, slice_bytes or capacity // 8))
        self._ring = None
        self._head = 0  # where the next copy goes
        self._used = 0  # bytes of the ring not written yet
        self._jobs = deque()  # (start, nbytes, offset, hash or None, digest row or None, ring bytes held)
        self._cond = threading.Condition()
        self._put = threading.Lock()
        self._gathered = bytearray()  # small arrays adjacent in the file, not written yet
        self._gathered_at = None  # their offset
        self._error = None
        self._thread = None
        self._stop = False

    def write(self, array, offset, *, digest_into=None):
        """Write ``array``'s C-order bytes at ``offset`` (None: none) and, with ``digest_into`` (32 writable
        ``uint8``), put their SHA-256 there.  Returns once the bytes are copied into the ring (waiting for room
        for a slice at a time when it is full); the digest is there once :meth:`wait` returns."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._raise()
        if raw.nbytes < self.inline_below:  # small: handing it over costs more than writing it
            if offset is not None:
                with self._put:
                    self._gather(raw, offset)
                self._raise()
            if digest_into is not None:
                digest_into[:] = sha256(raw)
            return
        if self._ring is None:
            self._ring = np.empty(self.capacity, dtype=np.uint8)
            self._thread = threading.Thread(target=self._run, name="qgcli-capture-writes", daemon=True)
            self._thread.start()
        hasher = hashlib.sha256() if digest_into is not None else None
        with self._put:  # one writer at a time: the jobs stay in the order of their places in the ring
            for first in range(0, max(raw.nbytes, 1), self.slice_bytes):
                piece = raw[first:first + self.slice_bytes]
                last = first + self.slice_bytes >= raw.nbytes
                self._hand_over(piece, None if offset is None else offset + first, hasher,
                                digest_into if last else None)

    def _gather(self, raw, offset):
        """Add a small array's bytes to those gathered when it follows them in the file (and they stay within
        :data:`GATHER_BYTES`); else write those first and start again from it."""
        end = None if self._gathered_at is None else self._gathered_at + len(self._gathered)
        if offset != end or len(self._gathered) + raw.nbytes > GATHER_BYTES:
            self._write_gathered()
            self._gathered_at = offset
        self._gathered += memoryview(raw)

    def _write_gathered(self):
        """Write the gathered bytes (a failure is kept, as the thread's: every later write and wait raises it)."""
        data, at = self._gathered, self._gathered_at
        self._gathered, self._gathered_at = bytearray(), None
        if data and self._error is None:
            try:
                pwrite_all(self.fd, np.frombuffer(data, dtype=np.uint8), at)
            except BaseException as exc:
                self._error = exc

    def _hand_over(self, piece, offset, hasher, digest_into):
        """Copy ``piece`` (at most a slice) into the ring, once there is room, and queue its job."""
        n = piece.nbytes
        with self._cond:
            while True:
                self._raise()
                if not self._used:  # all written: start again at the beginning
                    self._head = 0
                start = self._head if self._head + n <= self.capacity else 0
                held = n + (self.capacity - self._head if start != self._head else 0)  # with the end skipped
                if self._used + held <= self.capacity:
                    break
                self._cond.wait()
            self._head = start + n
            self._used += held
        self._ring[start:start + n] = piece
        with self._cond:
            self._jobs.append((start, n, offset, hasher, digest_into, held))
            self._cond.notify_all()

    def _run(self):
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if not self._jobs:
                    return
                start, n, offset, hasher, digest_into, held = self._jobs[0]
            try:
                if self._error is None:
                    data = self._ring[start:start + n]
                    if offset is not None:
                        pwrite_all(self.fd, data, offset)
                    if hasher is not None:
                        hasher.update(memoryview(data))
                    if digest_into is not None:
                        digest_into[:] = np.frombuffer(hasher.digest(), dtype=np.uint8)
            except BaseException as exc:  # reported to the step by the next write or wait
                self._error = exc
            with self._cond:
                self._jobs.popleft()
                self._used -= held
                self._cond.notify_all()

    def _raise(self):
        if self._error is not None:  # kept: every later write and wait fails
            raise self._error

    def wait(self, *, raise_error=True):
        """Return when every write handed over is in the file; raise the thread's error (``raise_error``)."""
        with self._put:
            self._write_gathered()
        with self._cond:
            while self._jobs:
                self._cond.wait()
        if raise_error:
            self._raise()

    def close(self):
        """Wait for the writes, stop the thread and free the ring (errors are the caller's to :meth:`wait` for
        first)."""
        with self._put:
            self._write_gathered()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._ring = None
        self._jobs.clear()
        self._error = None
