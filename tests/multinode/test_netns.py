"""The namespaced-hosts harness itself, and a plain gloo all_reduce across two hosts via torchrun."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import netns  # noqa: E402

HERE = Path(__file__).parent
SKIP = netns.skip_reason()
needs_netns = pytest.mark.skipif(SKIP is not None, reason=f"no network namespaces: {SKIP}")
pytestmark = pytest.mark.slow


def _ours() -> set[str]:
    return {n for n in netns._namespaces() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")}


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _root_addrs() -> str:
    return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout


@needs_netns
def test_hosts_have_addresses_reach_each_other_and_are_removed():
    server = (
        "import socket;s=socket.socket();s.bind(('0.0.0.0',5555));s.listen();c,_=s.accept();c.sendall(c.recv(16)[::-1])"
    )
    links_before = _root_links()
    with netns.hosts(3) as hosts:
        assert [h.index for h in hosts] == [1, 2, 3]
        assert len({h.addr for h in hosts}) == 3
        assert len(_ours()) == 4  # three hosts and the switch
        for h in hosts:
            out = subprocess.run(
                h.cmd(["ip", "-br", "addr", "show", h.ifname]), capture_output=True, text=True, check=True
            ).stdout
            assert f"{h.addr}/24" in out
        srv = hosts[2].popen([sys.executable, "-c", server])
        client = (
            "import socket,time\n"
            "for _ in range(50):\n"
            "    try: c=socket.create_connection((%r,5555),timeout=1); break\n"
            "    except OSError: time.sleep(0.1)\n"
            "c.sendall(b'copus'); print(c.recv(16).decode())\n"
        ) % hosts[2].addr
        out = subprocess.run(hosts[0].cmd([sys.executable, "-c", client]), capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "supoc", out.stderr
        srv.wait(timeout=10)
        # nothing was added to the caller's namespace: the links live only inside the namespaces
        assert _root_links() == links_before
        assert all(h.addr.rsplit(".", 1)[0] not in _root_addrs() for h in hosts)
    assert _ours() == set()


@needs_netns
def test_hosts_are_removed_after_an_exception_with_processes_still_running():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.hosts(2) as hosts:
            sleeper = hosts[1].popen(["sleep", "600"])
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) != 0
    assert _ours() == set()


@needs_netns
def test_stale_namespaces_of_dead_creators_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}{dead.pid}-deadbeef-sw"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netns.remove_stale()
    assert name not in netns._namespaces()


@needs_netns
def test_torchrun_c10d_gloo_all_reduce_across_two_namespaced_hosts(tmp_path):
    with netns.hosts(2) as hosts:
        before = [netns.rx_bytes(h) for h in hosts]
        procs = []
        for h in hosts:
            argv = netns.torchrun_argv(
                h,
                hosts[0],
                [str(HERE / "allreduce_worker.py"), str(tmp_path)],
                nnodes="2",
                nproc_per_node=1,
                rdzv_id="allreduce",
            )
            env = dict(os.environ, COPUS_TEST_HOST_ADDR=h.addr, MASTER_ADDR=hosts[0].addr)
            procs.append(h.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        results = netns.wait_all(procs, timeout_s=120)
        after = [netns.rx_bytes(h) for h in hosts]
    for rc, out in results:
        assert rc == 0, out[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    addrs = [h.addr for h in hosts]
    for r, rec in enumerate(records):
        assert rec["world_size"] == 2 and rec["sum"] == 3.0  # (0+1) + (1+1)
        assert rec["local_world_size"] == 1
        assert rec["master_addr"] == addrs[0]
        assert rec["peers"] == addrs  # rank r ran on host r+1 (group_rank r)
        assert rec["group_rank"] == r
    assert all(b > a for a, b in zip(before, after))  # the bytes went over the veth links


def _skip_reason_with(prefix: list[str], env: dict | None = None) -> str:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import netns; print(netns.skip_reason())"
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_skip_reason_without_iproute2():
    assert "`ip` is not installed" in _skip_reason_with([], dict(os.environ, PATH="/nonexistent"))


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop privileges"
)
def test_skip_reason_when_not_root():
    reason = _skip_reason_with(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert "need root" in reason and "65534" in reason
