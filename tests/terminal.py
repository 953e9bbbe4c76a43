"""Run a command with stdout and stderr on a real pseudo-terminal of a given size (POSIX)."""
import fcntl
import os
import select
import struct
import subprocess
import termios
import time

import pytest

from checkout import checkout_env


def run_on_terminal(argv, *, width, height=50, cwd=None, env=None, timeout=60):
    """``(exit code, bytes the terminal received)``; the process is always waited for and the terminal closed.
    A command run from the checkout without compiled kernels says nothing about them (tests/checkout.py)."""
    env = checkout_env(env)
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd, env=env,
                                close_fds=True)
    finally:
        os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                pytest.fail(f"{argv[:3]} did not finish within {timeout} s")
            ready, _, _ = select.select([master], [], [], min(left, 1.0))
            if not ready:
                if proc.poll() is not None and not select.select([master], [], [], 0.2)[0]:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(master)
    return code, b"".join(chunks)
