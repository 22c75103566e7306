#!/usr/bin/env python3
"""Probe for the "published on 127.0.0.1 but reachable from the adjacent LAN" hole.

Docker 20.10 publishes ``-p 127.0.0.1:PORT:...`` with a nat PREROUTING DNAT rule that matches
``ip daddr 127.0.0.1`` on any interface but the bridge.  A neighbour on the same L2 segment can send a
frame to the host's MAC whose IPv4 destination is 127.0.0.1; the DNAT rewrites the destination before the
kernel's martian check sees it, so the packet is forwarded to the container (moby/moby#41872,
moby/moby#45610; Debian's docker.io 20.10.24 on the testbed answers such a SYN without a firewall).

The kernel of the sending side will not route 127.0.0.1 out of eth0, so this script builds the Ethernet,
IPv4 and TCP headers itself and sends one SYN through an AF_PACKET socket (needs CAP_NET_RAW), then
listens for the answer.

Usage: localnet_probe.py --iface eth0 --via 10.231.0.22 --port 8000 [--dst 127.0.0.1] [--timeout 3] [--tries 3]
Prints one line of JSON: {"answer": "syn-ack" | "rst" | "none", ...}.
Exit status: 0 when nothing answered (the hole is closed), 1 when the target answered (reachable),
2 on a usage or environment error.
"""
import argparse
import json
import random
import socket
import struct
import sys
import time

ETH_P_IP = 0x0800


def checksum(data: bytes) -> int:
    """RFC 1071 Internet checksum of ``data`` (bytes) -> 16-bit int."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def neighbour_mac(iface: str, ip: str, timeout_s: float) -> str:
    """MAC address (aa:bb:..) of ``ip`` on ``iface`` from the ARP table, resolving it first with a UDP
    datagram to the discard port.  Raises RuntimeError when it stays unresolved for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"", (ip, 9))
    while time.monotonic() < deadline:
        with open("/proc/net/arp", encoding="ascii") as arp:
            for line in arp.readlines()[1:]:
                f = line.split()
                if f[0] == ip and f[5] == iface and f[3] != "00:00:00:00:00:00":
                    return f[3]
        time.sleep(0.1)
    raise RuntimeError(f"no ARP entry for {ip} on {iface}")


def syn_frame(src_mac, dst_mac, src_ip, dst_ip, sport, dport, seq) -> bytes:
    """One Ethernet frame carrying an IPv4 TCP SYN, checksums filled in."""
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x02, 64240, 0, 0)
    pseudo = socket.inet_aton(src_ip) + socket.inet_aton(dst_ip) + struct.pack("!BBH", 0, 6, len(tcp))
    tcp = tcp[:16] + struct.pack("!H", checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), random.randrange(65536), 0x4000, 64, 6, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    eth = bytes.fromhex(dst_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", "")) + struct.pack("!H", ETH_P_IP)
    return eth + ip + tcp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iface", default="eth0")
    ap.add_argument("--via", required=True, help="IPv4 address of the host whose MAC the frame goes to")
    ap.add_argument("--dst", default="127.0.0.1", help="IPv4 destination written into the packet")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer to each SYN")
    ap.add_argument("--tries", type=int, default=3, help="SYNs to send before calling the port closed")
    a = ap.parse_args()
    try:
        with open(f"/sys/class/net/{a.iface}/address", encoding="ascii") as fh:
            src_mac = fh.read().strip()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((a.via, 9))
            src_ip = s.getsockname()[0]
        dst_mac = neighbour_mac(a.iface, a.via, a.timeout)
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_IP))
        sock.bind((a.iface, ETH_P_IP))
    except (OSError, RuntimeError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 2
    # Up to --tries SYNs (a fresh source port each), like a TCP client's own retransmissions: one frame
    # can be lost while the box's bridge or ARP entry settles, which would read as "closed".
    answer = "none"
    sock.settimeout(0.2)
    for _ in range(a.tries):
        sport = random.randrange(20000, 60000)
        sock.send(syn_frame(src_mac, dst_mac, src_ip, a.dst, sport, a.port, random.randrange(1 << 32)))
        deadline = time.monotonic() + a.timeout
        while time.monotonic() < deadline and answer == "none":
            try:
                frame = sock.recv(2048)
            except TimeoutError:
                continue
            ip = frame[14:]
            if len(ip) < 40 or ip[9] != 6:
                continue
            ihl = (ip[0] & 0x0F) * 4
            sp, dp = struct.unpack("!HH", ip[ihl:ihl + 4])
            flags = ip[ihl + 13]
            if sp == a.port and dp == sport:
                answer = "syn-ack" if flags & 0x12 == 0x12 else ("rst" if flags & 0x04 else f"flags-{flags:#x}")
        if answer != "none":
            break
    print(json.dumps({"answer": answer, "src": src_ip, "via": a.via, "dst": a.dst, "port": a.port}))
    return 0 if answer == "none" else 1


if __name__ == "__main__":
    sys.exit(main())
