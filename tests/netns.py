"""Network namespaces joined by a veth pair, as if two separate hosts (`ip netns`).

Tests that need them call `two_hosts()` from a fixture; where namespaces cannot be made
(not root, no iproute2, no veth in this kernel) it skips with the reason. The namespaces
are deleted afterwards, which deletes their ends of the veth pair too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Host:
    """One namespace and the address its end of the veth pair has."""

    ns: str
    ip: str

    def exec_prefix(self) -> list[str]:
        """Prefix of a command line that runs the command inside this namespace."""
        return ["ip", "netns", "exec", self.ns]


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns)"
    probe = f"pl-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Namespaces a (10.77.x.1) and b (10.77.x.2) joined by a veth pair; removed after."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:5]
    a, b = f"pl-a-{tag}", f"pl-b-{tag}"
    net = f"10.77.{int(tag[:2], 16)}"
    try:
        try:
            _sh("ip", "netns", "add", a)
            _sh("ip", "netns", "add", b)
            _sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
            _sh("ip", "link", "set", f"va{tag}", "netns", a)
            _sh("ip", "link", "set", f"vb{tag}", "netns", b)
            for ns, dev, ip in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
                _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:  # e.g. no veth support in this kernel
            pytest.skip(f"cannot build the two namespaces: {' '.join(exc.cmd)}: {exc.stderr}")
        yield Host(a, f"{net}.1"), Host(b, f"{net}.2")
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        # a pair left in this namespace by a failed move (deleting one end deletes both)
        subprocess.run(["ip", "link", "del", f"va{tag}"], check=False, capture_output=True)
