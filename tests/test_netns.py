"""The namespace lab: addressing, NAT semantics (outbound works, inbound dropped, punching), caps, teardown."""

import subprocess
import sys
import time

import pytest

from lab.netns import NetnsError, Network, enter_namespace, netns_unavailable_reason
from lab.swarm import ForkedProcess

_reason = netns_unavailable_reason(need_iptables=True)
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

# A one-shot TCP server that replies with the address it saw, and a client that prints the reply.
SERVER = (
    "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
    "s.bind(('0.0.0.0',7000));s.listen();print('ready',flush=True);s.settimeout(20);"
    "c,a=s.accept();c.sendall(a[0].encode());c.close()"
)
CLIENT = (
    "import socket,sys;c=socket.create_connection((sys.argv[1],7000),timeout=2);"
    "print(c.recv(100).decode())"
)
# TCP simultaneous open: bind a fixed port, connect to the other side's NAT at its fixed port, retry.
PUNCH = (
    "import socket,sys,time\n"
    "local,peer,port=int(sys.argv[1]),sys.argv[2],int(sys.argv[3])\n"
    "for _ in range(8):\n"
    "    s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',local))\n"
    "    s.settimeout(0.5)\n"
    "    try:\n"
    "        s.connect((peer,port));s.sendall(b'hi');print('punched',s.recv(2).decode());break\n"
    "    except OSError:\n"
    "        s.close();time.sleep(0.2)\n"
    "else:\n"
    "    print('failed')\n"
)


def _serve(ns):
    proc = ns.popen([sys.executable, "-u", "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _connect(src, dst_address):
    return src.run(sys.executable, "-c", CLIENT, dst_address, check=False)


def _pids(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_nat_lets_out_and_keeps_in_and_teardown_removes_everything():
    with Network(prefix="tn") as net:
        pub = net.host("pub")
        home = net.nat("home")
        b = net.host("b", behind=home)
        assert pub.address.startswith("10.") and b.address.startswith("10.")
        names = {ns.name for ns in net.namespaces} | {net.bridge_ns}
        assert names <= _namespaces()

        _serve(pub)
        out = _connect(b, pub.address)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == home.address  # the public side sees the NAT, not b

        server = _serve(b)
        assert _connect(pub, b.address).returncode != 0  # not routable from outside
        assert _connect(pub, home.address).returncode != 0  # the NAT drops unsolicited inbound
    assert server.poll() is not None  # killed on teardown
    assert not names & _namespaces()


def test_teardown_on_exception_kills_processes_and_namespaces():
    with pytest.raises(KeyboardInterrupt):
        with Network(prefix="tn") as net:
            a = net.host("a")
            sleeper = a.popen([sys.executable, "-c", "import time; time.sleep(600)"])
            names = {ns.name for ns in net.namespaces} | {net.bridge_ns}
            raise KeyboardInterrupt
    assert sleeper.wait(timeout=5) is not None
    assert not names & _namespaces()


def test_a_forked_process_enters_its_namespace_and_dies_with_it(tmp_path):
    with Network(prefix="tn") as net:
        a, pub = net.host("a"), net.host("pub")
        server = a.adopt(ForkedProcess(exec, (SERVER,), tmp_path / "server.log", netns=a.name))
        deadline = time.monotonic() + 30
        log = tmp_path / "server.log"
        while not (log.exists() and "ready" in log.read_text()) and time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()
            time.sleep(0.05)
        out = _connect(pub, a.address)  # it listens on a's address, inside a
        assert (out.returncode, out.stdout.strip()) == (0, pub.address), out.stderr
        sleeper = a.adopt(ForkedProcess(time.sleep, (600,), tmp_path / "sleeper.log", netns=a.name))
        deadline = time.monotonic() + 30  # the kernel lists it among a's processes once it has entered
        while str(sleeper.pid) not in _pids(a.name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(sleeper.pid) in _pids(a.name)
    assert sleeper.wait(timeout=5) is not None


def test_entering_a_namespace_that_does_not_exist_names_it():
    with pytest.raises(NetnsError, match="namespace tn-absent"):
        enter_namespace("tn-absent")


def test_leftovers_of_a_dead_run_are_removed():
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    leftover = f"tn{pid_max + 1}-old"  # no process can have this id
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        with Network(prefix="tn"):
            assert leftover not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)


def test_link_cap_on_both_ends():
    with Network(prefix="tn") as net:
        a = net.host("a", link_mbit=20)
        qdisc = a.run("tc", "qdisc", "show", "dev", "eth0").stdout
        assert "tbf" in qdisc and "20Mbit" in qdisc
        bridge = subprocess.run(["tc", "-n", net.bridge_ns, "qdisc", "show"], capture_output=True, text=True)
        assert "20Mbit" in bridge.stdout
        with pytest.raises(ValueError, match="link_mbit"):
            net.host("c", link_mbit=0)


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="prefix"):
        Network(prefix="bad-prefix")
    with Network(prefix="tn") as net:
        with pytest.raises(ValueError, match="label"):
            net.host("no spaces")
        net.host("x")
        with pytest.raises(NetnsError, match="netns add"):
            net.host("x")  # the same name twice


@pytest.mark.parametrize("random_fully, expected", [(False, "punched hi"), (True, "failed")])
def test_tcp_hole_punch_passes_plain_nat_but_not_port_randomising_nat(random_fully, expected):
    with Network(prefix="tn") as net:
        nat1, nat2 = net.nat("home1"), net.nat("home2", random_fully=random_fully)
        a, b = net.host("a", behind=nat1), net.host("b", behind=nat2)
        started = time.monotonic()
        pa = a.popen([sys.executable, "-c", PUNCH, "4001", nat2.address, "4002"], stdout=subprocess.PIPE, text=True)
        pb = b.popen([sys.executable, "-c", PUNCH, "4002", nat1.address, "4001"], stdout=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=30)[0].strip() for p in (pa, pb)]
        assert outs == [expected, expected], (outs, time.monotonic() - started)


def test_cutting_the_link_between_sides_partitions_them_and_restoring_it_heals():
    with Network(prefix="tn") as net:
        a, b, c = net.host("a"), net.host("b"), net.host("c", side=1)

        def reaches(src, dst) -> bool:
            server = _serve(dst)
            try:
                return _connect(src, dst.address).stdout.strip() == src.address
            finally:
                server.kill()
                server.wait()

        assert reaches(a, c)
        net.join_sides(False)
        assert reaches(a, b) and not reaches(a, c) and not reaches(c, a)
        net.join_sides(True)
        assert reaches(a, c)
        with pytest.raises(ValueError, match="side"):
            net.host("d", side=2)
