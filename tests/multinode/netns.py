"""Several "hosts" on one machine: Linux network namespaces joined by veth pairs to a bridge.

Layout (nothing is changed in the caller's own network namespace):

    copus-<pid>-<tag>-sw          a "switch" namespace holding the bridge `br0`
    copus-<pid>-<tag>-h1 .. hN    one namespace per host, interface `veth0` = 10.A.B.i/24, `lo` up
                                  (its peer `p<i>` sits in the switch namespace, enslaved to br0)

Every link is created *inside* the namespaces (`ip -n NS link add ... peer ... netns NS2`), so
traffic between hosts never leaves them. `hosts(n)` is a context manager; on exit (also on an
exception, Ctrl-C or SIGTERM) it kills every process still inside the namespaces and deletes them.
Namespaces left behind by a process that died with SIGKILL are removed on the next `hosts()` call
(the creator's pid is part of the name).

Commands run inside a host with `ip netns exec NAME ...` (`Host.cmd`), which keeps the caller's
environment; `Host.env()` adds what PyTorch's TCP transports need to pick the right interface
(GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2; `skip_reason()` says why not otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

PREFIX = "copus-"
IFNAME = "veth0"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+-(sw|h\d+)$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """One namespaced host: its namespace name, address on the bridge and interface name."""

    name: str
    addr: str
    index: int
    ifname: str = IFNAME

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for PyTorch processes on this host: transports bound to `veth0`."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=self.ifname, TP_SOCKET_IFNAME=self.ifname, NCCL_SOCKET_IFNAME=self.ifname)
        return env

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` in this namespace, in a new session (so `kill_group` reaches children)."""
        return subprocess.Popen(self.cmd(argv), env=self.env(env), start_new_session=True, **kwargs)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def skip_reason() -> str | None:
    """None if network namespaces can be made here, else one line saying why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (needed for `ip netns`)"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    probe = f"{PREFIX}{os.getpid()}-{random.getrandbits(32):08x}-sw"
    try:
        out = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` could not run: {exc}"
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip() or out.returncode}"
    veth = _ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb", check=False)
    _ip("netns", "del", probe, check=False)
    if veth.returncode != 0:
        return f"veth pairs cannot be made in a namespace: {veth.stderr.strip()}"
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete copus namespaces whose creating process no longer exists; return their names."""
    removed = []
    for name in _namespaces():
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_inside(name: str, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process running in namespace `name` (all of them ours)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not _ip("netns", "pids", name, check=False).stdout.split():
                return
            time.sleep(0.1)


def _make(n: int, tag: str, subnet: str) -> tuple[str, list[Host]]:
    base = f"{PREFIX}{os.getpid()}-{tag}"
    switch = f"{base}-sw"
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "set", "lo", "up")
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    hosts = []
    for i in range(1, n + 1):
        host = Host(name=f"{base}-h{i}", addr=f"{subnet}.{i}", index=i)
        _ip("netns", "add", host.name)
        _ip("-n", host.name, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFNAME, "netns", host.name)
        _ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
        _ip("-n", switch, "link", "set", f"p{i}", "up")
        _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
        _ip("-n", host.name, "link", "set", IFNAME, "up")
        hosts.append(host)
    return switch, hosts


def _teardown(names: Sequence[str]) -> None:
    for name in names:
        _kill_inside(name)
    for name in names:
        _ip("netns", "del", name, check=False)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while inside, so `finally` blocks run (main thread)."""
    try:
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """`n` namespaced hosts on one bridge, addresses 10.A.B.1..n/24; all removed on exit."""
    if not 1 <= n <= 250:
        raise ValueError(f"n={n} is invalid; allowed: 1..250 hosts")
    remove_stale()
    tag = f"{random.getrandbits(32):08x}"
    subnet = f"10.{random.randint(64, 250)}.{random.randint(1, 250)}"
    base = f"{PREFIX}{os.getpid()}-{tag}"
    names = [f"{base}-sw"] + [f"{base}-h{i}" for i in range(1, n + 1)]
    with _sigterm_as_interrupt():
        try:
            _, made = _make(n, tag, subnet)
            yield made
        finally:
            _teardown([x for x in names if x in set(_namespaces())])


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the session started by `Host.popen` (the command and all its children)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    """Wait for every process (stdout captured as text); kill all on timeout.

    Returns (returncode, output) per process; a timed-out process gets returncode None → -9.
    """
    deadline = time.monotonic() + timeout_s
    results: list[tuple[int, str]] = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                kill_group(other, signal.SIGKILL)
            out, _ = proc.communicate()
            out = (out or "") + f"\n[netns harness: killed after {timeout_s:.0f} s timeout]"
        results.append((proc.returncode, out or ""))
    return results


def torchrun_argv(
    host: Host,
    rdzv_host: Host,
    argv: Sequence[str],
    *,
    nnodes: str,
    nproc_per_node: int,
    rdzv_id: str,
    port: int = 29400,
    max_restarts: int = 0,
    python: str | None = None,
    rdzv_conf: Mapping[str, object] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`torchrun --nnodes ... --rdzv-backend c10d --rdzv-endpoint HOST1:PORT <argv>` for `host`.

    `--local-addr` makes the agent advertise its veth address (the machine's hostname resolves
    to 127.0.0.1 in every namespace), and `is_host` says which agent serves the c10d store: the
    automatic check compares the endpoint with the machine's hostname/addresses, which fails
    here for the same reason. `rdzv_conf` adds c10d rendezvous settings (last_call_timeout,
    keep_alive_interval, ...).
    """
    conf_items = {"is_host": "true" if host == rdzv_host else "false", "join_timeout": 60, **(rdzv_conf or {})}
    conf = ",".join(f"{k}={v}" for k, v in conf_items.items())
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{rdzv_host.addr}:{port}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        conf,
        "--local-addr",
        host.addr,
        "--max-restarts",
        str(max_restarts),
        *extra,
        *argv,
    ]


def rx_bytes(host: Host) -> int:
    """Bytes received so far on the host's veth interface."""
    out = _ip("-n", host.name, "-s", "-j", "link", "show", host.ifname)
    return int(json.loads(out.stdout)[0]["stats64"]["rx"]["bytes"])


def kill_host(host: Host, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every process inside `host`'s namespace: the host "dies" (agent and workers; the
    elastic agent starts workers in sessions of their own, so a process-group kill misses them).
    Returns the pids signalled."""
    pids = [int(p) for p in _ip("netns", "pids", host.name, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids
