"""Run one experiment as N JAX processes on this machine: `python launch/local_cluster.py -n 2 --
<launch/run.py args>`.

Each process runs `launch/run.py <args> --dist.coordinator=localhost:<free port>
--dist.num_processes=N --dist.process_id=i`; on CPU each gets `--devices-per-process` simulated
devices and the processes talk over gloo, so a multi-host run can be tried (and tested) on one
machine. Output lines are prefixed with the process index. Ctrl-C is forwarded to every process.
When a process fails, the others are given `--grace-s` seconds to stop on their own (they do:
their next collective fails), then killed. The exit code is 0 only if every process succeeded.

    python launch/local_cluster.py -n 2 -- --config configs/default.py --mesh.trainer=2x1
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "launch" / "run.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def child_env(devices: int, platform: str) -> dict:
    env = dict(os.environ)
    if platform:
        env["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
        env["JAXRL_CPU_DEVICES"] = str(devices)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(index: int, stream, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
            out.flush()
    stream.close()


class Cluster:
    def __init__(self, n: int, run_args: list[str], *, devices: int = 1, platform: str = "cpu",
                 port: int | None = None, grace_s: float = 30.0, out=None):
        if n < 1:
            raise ValueError(f"-n must be >= 1, got {n}")
        self.n, self.run_args, self.devices, self.platform = n, run_args, devices, platform
        self.port = port or free_port()
        self.grace_s = grace_s
        self.out = out or sys.stdout
        self.procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._lock:
            self.out.write(f"[local_cluster] {text}\n")
            self.out.flush()

    def start(self) -> None:
        env = child_env(self.devices, self.platform)
        for i in range(self.n):
            cmd = [sys.executable, str(RUN), *self.run_args,
                   f"--dist.coordinator=localhost:{self.port}",
                   f"--dist.num_processes={self.n}", f"--dist.process_id={i}"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    start_new_session=True)  # Ctrl-C reaches them through us
            self.procs.append(proc)
            self.say(f"process {i} started (pid {proc.pid})")
            t = threading.Thread(target=_pump, args=(i, proc.stdout, self.out, self._lock),
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM the processes still running, SIGKILL what is left after `grace_s`."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self) -> int:
        """Wait for every process; on the first failure, stop the rest. Returns the exit code."""
        failed: tuple[int, int] | None = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    running = [i for i, c in enumerate(codes) if c is None]
                    self.say(f"process {failed[0]} exited with code {failed[1]}; "
                             + (f"stopping processes {running} (within {self.grace_s:.0f}s)"
                                if running else "no process left running"))
                    self.stop_all(self.grace_s)
                    break
                if all(c == 0 for c in codes):
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            self.say("interrupted: forwarding Ctrl-C to every process")
            self.signal_all(signal.SIGINT)
            self.stop_all(self.grace_s)
            failed = failed or (-1, 130)
        finally:
            if any(p.poll() is None for p in self.procs):
                self.stop_all(0)
            for t in self._threads:
                t.join(5)
        if failed is None:
            self.say(f"all {self.n} processes finished")
            return 0
        codes = {i: p.returncode for i, p in enumerate(self.procs)}
        self.say(f"failed: exit codes {codes}")
        return failed[1] if failed[1] > 0 else 1


def main(argv: list[str]) -> int:
    if "--" in argv:
        split = argv.index("--")
        own, run_args = argv[:split], argv[split + 1:]
    else:
        own, run_args = argv, []
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices per process (platform cpu)")
    parser.add_argument("--platform", default="cpu",
                        help="JAX_PLATFORMS for the processes ('' = leave as is)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="after one process fails, how long the others may take to stop")
    args = parser.parse_args(own)
    owned = ("--dist.coordinator", "--dist.num_processes", "--dist.process_id")
    if any(a.startswith(owned) for a in run_args):
        parser.error(f"{', '.join(owned)} are set by local_cluster.py; remove them from the "
                     "run arguments")
    cluster = Cluster(args.num_processes, run_args, devices=args.devices_per_process,
                      platform=args.platform, port=args.port, grace_s=args.grace_s)
    cluster.start()
    return cluster.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
