"""Time shell commands side by side: each round runs every command once, so that a load that comes and goes
weighs on all of them alike; round r starts with the r-th command (in the order given after it).

    python benchmarks/paired.py REPEATS 'COMMAND' ['COMMAND' ...]

Prints one line per command: the median wall time in seconds over REPEATS rounds and the peak resident set
size in MB (the largest of its runs, from the kernel's rusage of the command's process tree).  A command
that fails stops the run with its stderr.
"""
import os
import statistics
import subprocess
import sys
import time


def run(command):
    start = time.perf_counter()
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if status:
        sys.exit(f"FAILED ({status >> 8}): {command}\n{err}")
    return seconds, usage.ru_maxrss / 1024  # ru_maxrss: KiB on Linux


def main():
    repeats, commands = int(sys.argv[1]), sys.argv[2:]
    times = [[] for _ in commands]
    peaks = [0.0] * len(commands)
    for round_ in range(repeats):
        # Each round starts one command later, so that each follows every other alike: a command that
        # always ran right after TensorFlow's (which leaves gigabytes of memory to be reclaimed) paid for it.
        for k in range(len(commands)):
            i = (round_ + k) % len(commands)
            seconds, peak = run(commands[i])
            times[i].append(seconds)
            peaks[i] = max(peaks[i], peak)
    for t, peak in zip(times, peaks):
        print(f"{statistics.median(t):.3f} {peak:.0f}")


if __name__ == "__main__":
    main()
