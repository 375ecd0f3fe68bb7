"""An emulated cluster on one Linux machine: one network namespace per host.

Each emulated host is a network namespace (``ip netns``) with its own UTS name (its
hostname), joined to the others by a veth link through a bridge in the starting
namespace. The links stand for the inter-host network: a token-bucket filter (``tc``)
limits each host's sending and receiving rate, and ``netem`` adds delay where the kernel
has it. Ranks of one host share memory as on a real machine; ranks of different hosts
talk TCP over the rate-limited links.

MPI jobs start with MPICH's hydra ``mpiexec`` in the starting namespace; its ssh launcher
is replaced by a script that starts each host's proxy with ``ip netns exec`` (and a UTS
namespace named after the host), and the hostfile names the hosts by their addresses.
UCX and libfabric are told to use TCP between hosts: by default they would find the
other namespaces' processes on the same kernel and use shared memory, bypassing the
links.

Everything is removed when the ``with`` block ends, also when it ends with an error;
namespaces and links left by a killed process are recognisable by their name prefix and
removed by the next start. Needs root (or CAP_NET_ADMIN), iproute2, ``unshare`` and
hydra; ``unavailable_reason()`` says what is missing.

As a script, it runs one command across an emulated cluster::

    python -m meshplan.testing.emulated_cluster --hosts 2 --slots 2 --rate 1gbit -- \\
        meshplan run PLAN --inputs in.npz

(the command after ``--`` is started by ``mpiexec -n HOSTS*SLOTS -ppn SLOTS``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mpc"          # every namespace and link this module makes is named PREFIX<pid>n<k>…
_COUNTER = itertools.count()
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g)?bit\s*$", re.IGNORECASE)


def rate_bits(text: str) -> float:
    """'1gbit' → 1e9, '200mbit' → 2e8 (bits per second)."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"expected a rate such as 1gbit or 200mbit, got {text!r}")
    scale = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[(match.group(2) or "").lower() or None]
    return float(match.group(1)) * scale


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def hydra_mpiexec(mpiexec: str | None = None) -> str | None:
    """The hydra mpiexec to use (next to this Python first), or None."""
    found = mpiexec or shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        return None
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found if "HYDRA" in version else None


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    if hydra_mpiexec() is None:
        return "the emulated cluster starts jobs with MPICH's hydra mpiexec, which is not on PATH"
    probe = f"{PREFIX}probe{os.getpid()}"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot make a network namespace: {done.stderr.strip()}"
    try:
        link = _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if link.returncode != 0:
            return f"cannot make a veth link: {link.stderr.strip()}"
        shaped = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
                      "rate", "1gbit", "burst", "64kb", "latency", "50ms", check=False)
        if shaped.returncode != 0:
            return f"cannot rate-limit a link (tc tbf): {shaped.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _netem_available(namespace: str, device: str) -> bool:
    done = _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "netem",
                "delay", "1ms", check=False)
    if done.returncode == 0:
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root", check=False)
    return done.returncode == 0


def remove_stale() -> None:
    """Remove namespaces and bridges left by emulated clusters whose process has ended."""
    def dead(name: str) -> bool:
        match = re.match(rf"^{PREFIX}(\d+)", name)
        if not match:
            return False
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if dead(name):
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and dead(parts[1].strip()):
            _run("ip", "link", "del", parts[1].strip(), check=False)


@dataclass
class EmulatedCluster:
    """``hosts`` namespaces of ``slots`` ranks each; links of ``rate`` (e.g. '1gbit') and
    ``delay_ms`` one way (applied only where the kernel has netem: see ``delay_applied``)."""

    hosts: int = 2
    slots: int = 2
    rate: str = "1gbit"
    delay_ms: float = 0.0
    mpiexec: str | None = None
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}n{next(_COUNTER)}")
    delay_applied: bool = False
    _subnet: str | None = field(default=None, repr=False)
    _made: list[str] = field(default_factory=list, repr=False)
    _bridge: str | None = field(default=None, repr=False)
    _dir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    # --- names ------------------------------------------------------------------------

    @property
    def namespaces(self) -> list[str]:
        return [f"{self.tag}h{i}" for i in range(self.hosts)]

    @property
    def subnet(self) -> str:
        if self._subnet is None:
            used = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
            for k in range(250 * 50):
                candidate = f"10.{200 + (os.getpid() + k) % 50}.{(os.getpid() // 50 + k) % 250}"
                if f" {candidate}." not in used:
                    self._subnet = candidate
                    break
        return self._subnet

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def hostfile(self) -> Path:
        return Path(self._dir.name) / "hostfile"

    @property
    def launcher(self) -> Path:
        return Path(self._dir.name) / "netns-launch"

    @property
    def bits_per_second(self) -> float:
        return rate_bits(self.rate)

    # --- set-up and tear-down -----------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.mpiexec = hydra_mpiexec(self.mpiexec)
        remove_stale()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shape(self, namespace: str | None, device: str) -> None:
        prefix = ("ip", "netns", "exec", namespace) if namespace else ()
        rate_bps = self.bits_per_second
        # A small bucket (0.5 ms of traffic, at least two full frames): a larger one lets
        # short messages through at memory speed, which no real link does.
        burst = max(2 * 1514, int(rate_bps / 8 * 5e-4))
        if self.delay_ms > 0 and namespace and _netem_available(namespace, device):
            _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                 "delay", f"{self.delay_ms}ms")
            _run(*prefix, "tc", "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", "tbf",
                 "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms")
            self.delay_applied = True
            return
        _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf",
             "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms")

    def _start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="meshplan-cluster-")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge = self.bridge
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, namespace in enumerate(self.namespaces):
            _run("ip", "netns", "add", namespace)
            self._made.append(namespace)
            outside = f"{self.tag}v{i}"
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _run("ip", "link", "set", outside, "master", self.bridge)
            _run("ip", "link", "set", outside, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            self._shape(namespace, "eth0")      # what the host sends
            self._shape(None, outside)          # what it receives
        self.hostfile.write_text("".join(f"{self.address(i)}:{self.slots}\n" for i in range(self.hosts)))
        cases = "".join(f"    {self.address(i)}) ns={ns} ;;\n" for i, ns in enumerate(self.namespaces))
        self.launcher.write_text(
            "#!/bin/sh\n"
            "# Started by hydra as its ssh: [options] HOST COMMAND...; runs COMMAND in HOST's namespace.\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            'host="$1"; shift\n'
            'case "$host" in\n'
            f"{cases}"
            '    *) echo "no emulated host $host" >&2; exit 1 ;;\n'
            "esac\n"
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns && $*"\n'
        )
        self.launcher.chmod(self.launcher.stat().st_mode | stat.S_IXUSR)

    def close(self) -> None:
        for namespace in self._made:
            _run("ip", "netns", "del", namespace, check=False)
        self._made.clear()
        if self._bridge:
            _run("ip", "link", "del", self._bridge, check=False)
            self._bridge = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # --- running jobs -------------------------------------------------------------

    def environment(self, extra: dict | None = None) -> dict:
        """This process's environment plus ``extra``, with MPI between hosts over TCP (not
        shared memory)."""
        env = dict(os.environ) | dict(extra or {})
        env.update({"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"})
        return env

    def mpiexec_command(self, ranks: int | None = None, per_host: int | None = None) -> list[str]:
        """``mpiexec`` for a job across the hosts: ``per_host`` ranks on each in turn
        (default: the slots), so rank = host * per_host + local rank."""
        ranks = self.hosts * self.slots if ranks is None else ranks
        per_host = self.slots if per_host is None else per_host
        return [self.mpiexec, "-f", str(self.hostfile), "-launcher", "ssh", "-launcher-exec", str(self.launcher),
                "-iface", self.bridge, "-n", str(ranks), "-ppn", str(per_host)]

    def run(self, command: list[str], ranks: int | None = None, per_host: int | None = None,
            timeout: float = 300, env: dict | None = None, cwd: str | os.PathLike | None = None,
            ) -> subprocess.CompletedProcess:
        return subprocess.run([*self.mpiexec_command(ranks, per_host), *command], capture_output=True, text=True,
                              timeout=timeout, env=self.environment(env), cwd=cwd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run an MPI command across hosts emulated with network namespaces.")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="ranks per host")
    parser.add_argument("--rate", default="1gbit", help="inter-host link rate, e.g. 1gbit, 200mbit")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (needs the kernel's netem)")
    parser.add_argument("--per-host", type=int, help="ranks placed per host (default: --slots)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        rate_bits(args.rate)
    except ValueError as exc:
        parser.error(str(exc))
    reason = unavailable_reason()
    if reason:
        print(f"emulated_cluster: error: {reason}", file=sys.stderr)
        return 1
    with EmulatedCluster(args.hosts, args.slots, args.rate, args.delay_ms) as cluster:
        if args.delay_ms > 0 and not cluster.delay_applied:
            print("emulated_cluster: note: this kernel has no netem; links are rate-limited without added delay",
                  file=sys.stderr)
        done = subprocess.run([*cluster.mpiexec_command(per_host=args.per_host), *command],
                              env=cluster.environment())
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
