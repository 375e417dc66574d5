"""Run N copies of a command as one multi-process JAX job on this machine (loopback).

  python examples/launch_local.py --num-processes 2 --devices-per-process 4 -- \\
      python examples/train_lm.py --mesh data=2,model=4 --steps 5

Each copy gets JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES,
JAX_PROCESS_ID and JAX_NUM_CPU_DEVICES, which `shardfuse.parallel.distributed.initialize`
reads. Output lines are prefixed with the process id. If any process fails or the
timeout passes, every process is killed and the exit status is non-zero: nothing hangs.
On a real cluster the cluster manager starts one process per host instead (see the README).
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command, num_processes=2, devices_per_process=4, timeout=600.0, env=None) -> int:
    """Runs `command` (a list) `num_processes` times as one JAX job; returns the exit status."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"{num_processes=} and {devices_per_process=} must be >= 1")
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for pid in range(num_processes):
        child_env = dict(os.environ if env is None else env)
        child_env.update(
            JAX_COORDINATOR_ADDRESS=address,
            JAX_NUM_PROCESSES=str(num_processes),
            JAX_PROCESS_ID=str(pid),
            JAX_NUM_CPU_DEVICES=str(devices_per_process),
            JAX_PLATFORMS=child_env.get("JAX_PLATFORMS", "cpu"),
        )
        procs.append(
            subprocess.Popen(
                command,
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )

    def pump(pid, proc):
        for line in proc.stdout:
            sys.stdout.write(f"[p{pid}] {line}")
            sys.stdout.flush()

    threads = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                break
            if time.monotonic() > deadline:
                sys.stdout.write(f"launch_local: timeout after {timeout:.0f} s\n")
                status = 124
                break
            time.sleep(0.2)
        else:
            status = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in threads:
            t.join(timeout=5)
    return status


def main(argv=None):
    # shardfuse.cli's one-line errors (exit status 2); the launcher itself starts no JAX backend
    from shardfuse.cli import ArgumentParser, positive_int

    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=positive_int, default=2)
    parser.add_argument("--devices-per-process", type=positive_int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if not args.timeout > 0:
        parser.error(f"--timeout={args.timeout} must be > 0 (seconds)")
    return launch(command, args.num_processes, args.devices_per_process, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
