#!/usr/bin/env python3
"""Writes the committed seed corpora (fuzz/corpus/<target>/) from valid
examples: well-formed queues, requests, packets, frames and lines. The
snapshot seeds come from a real probe snapshot's state file
(corpus/snapshot_state/probe-full, copied from a test run)."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
F_NEXT, F_WRITE = 1, 2


def out(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


class Mem:
    """A 64 KiB guest memory image with one split queue per ring triple."""

    def __init__(self):
        self.b = bytearray(64 << 10)

    def put(self, addr, data):
        self.b[addr:addr + len(data)] = data

    def queue(self, desc, avail, size, chains):
        """chains: lists of (addr, len, writable); placed from index 0."""
        i = 0
        heads = []
        for chain in chains:
            heads.append(i)
            for k, (addr, ln, w) in enumerate(chain):
                last = k + 1 == len(chain)
                flags = (F_WRITE if w else 0) | (0 if last else F_NEXT)
                nxt = 0 if last else i + 1
                self.put(desc + 16 * i, struct.pack("<QIHH", addr, ln, flags, nxt))
                i += 1
        ring = b"".join(struct.pack("<H", h) for h in heads)
        self.put(avail, struct.pack("<HH", 0, len(heads)) + ring)


def rings(desc, avail, used):
    """The 6 header bytes naming a queue's rings (addr / 8)."""
    return struct.pack("<HHH", desc // 8, avail // 8, used // 8)


SIZE_8 = 3  # queue size byte: 1 << 3


def virtqueue():
    m = Mem()
    m.queue(0x1000, 0x1800, 8, [
        [(0x4000, 64, False), (0x5000, 128, True)],
        [(0x6000, 16, False)],
        [(0x7000, 32, True), (0x7100, 32, True)],
    ])
    hdr = bytes([0, SIZE_8]) + rings(0x1000, 0x1800, 0x2000)
    out("virtqueue_chain", "three-chains", hdr + struct.pack("<HH", 8, 4) + bytes(m.b[:0x8000]))
    hdr = bytes([1, SIZE_8]) + rings(0x1000, 0x1800, 0x2000)
    out("virtqueue_chain", "event-idx", hdr + struct.pack("<HH", 0, 0) + bytes(m.b[:0x8000]))


def block():
    for name, kind, sector, data_w in [("read", 0, 1, True), ("write", 1, 2, False),
                                       ("get-id", 8, 0, True), ("flush", 4, 0, None)]:
        m = Mem()
        m.put(0x8000, struct.pack("<IIQ", kind, 0, sector))
        m.put(0x9000, bytes(range(256)) * 2)
        chain = [(0x8000, 16, False)]
        if data_w is not None:
            chain.append((0x9000, 20 if kind == 8 else 512, data_w))
        chain.append((0xa000, 1, True))
        m.queue(0x1000, 0x1800, 8, [chain])
        hdr = bytes([0, 0, SIZE_8]) + rings(0x1000, 0x1800, 0x2000)
        out("virtio_block", name, hdr + bytes(m.b[:0xb000]))


def vsock_hdr(src_port, dst_port, op, ln, flags=0):
    return struct.pack("<QQIIIHHIII", 3, 2, src_port, dst_port, ln, 1, op, flags, 256 << 10, 0)


def vsock():
    for name, packets in [
        ("request", [(vsock_hdr(1234, 52, 1, 0), b"")]),
        ("rw-shutdown-rst", [(vsock_hdr(1234, 52, 5, 5), b"hello"),
                             (vsock_hdr(1234, 52, 4, 0, 3), b""),
                             (vsock_hdr(1234, 52, 3, 0), b"")]),
        ("credit", [(vsock_hdr(1234, 1 << 30, 7, 0), b""),
                    (vsock_hdr(1234, 1 << 30, 6, 0), b"")]),
    ]:
        m = Mem()
        rx = [[(0x8000 + 0x1200 * k, 44, True), (0x8100 + 0x1200 * k, 4096, True)] for k in range(2)]
        m.queue(0x1000, 0x1400, 8, rx)
        tx = []
        for k, (h, payload) in enumerate(packets):
            a = 0xc000 + 0x400 * k
            m.put(a, h)
            m.put(a + 0x100, payload)
            tx.append([(a, 44, False)] + ([(a + 0x100, len(payload), False)] if payload else []))
        m.queue(0x2000, 0x2400, 8, tx)
        m.queue(0x3000, 0x3400, 8, [[(0xf000, 8, True)]])
        hdr = bytes([0, SIZE_8]) + rings(0x1000, 0x1400, 0x1800) + \
            rings(0x2000, 0x2400, 0x2800) + rings(0x3000, 0x3400, 0x3800)
        out("virtio_vsock", name, hdr + bytes(m.b))


def balloon():
    """Inflate, deflate, statistics and free page reporting (flags 6:
    STATS_VQ and REPORTING, so the reporting queue is queue 3)."""
    m = Mem()
    m.put(0x8000, struct.pack("<4I", 10, 11, 12, 200000))
    m.put(0x8100, struct.pack("<I", 10))
    m.put(0x8200, struct.pack("<HQHQHQ", 4, 1 << 20, 5, 1 << 26, 6, 1 << 22))
    m.queue(0x1000, 0x1400, 8, [[(0x8000, 16, False)]])
    m.queue(0x2000, 0x2400, 8, [[(0x8100, 4, False)]])
    m.queue(0x3000, 0x3400, 8, [[(0x8200, 30, False)]])
    m.queue(0x4000, 0x4400, 8, [[(0xa000, 0x2000, True)], [(0xe000, 0x4000, True)]])
    hdr = bytes([6, SIZE_8]) + b"".join(
        rings(q, q + 0x400, q + 0x800) for q in (0x1000, 0x2000, 0x3000, 0x4000))
    out("virtio_balloon", "all-queues", hdr + bytes(m.b))


def header():
    out("vsock_header", "rw", vsock_hdr(1234, 52, 5, 5))
    out("vsock_header", "request", vsock_hdr(1234, 52, 1, 0))


def snapshots():
    probe = open(os.path.join(HERE, "corpus", "snapshot_state", "probe-full"), "rb").read()
    payload = probe[32:]
    out("snapshot_state", "probe-payload", b"\x00" + payload)
    out("snapshot_state", "probe-file", b"\x01" + probe)
    lineage = json.dumps({"version": 1, "layers": ["@TOP@"]}).encode()
    top = b"\x00" + payload
    out("snapshot_layers", "probe-full",
        bytes([64]) + struct.pack("<H", len(top)) + top + struct.pack("<H", 0) + lineage)


def frame(obj):
    b = json.dumps(obj).encode()
    return struct.pack(">I", len(b)) + b


def agent():
    hello = frame({"id": 0, "type": "hello", "protocol": {"major": 1, "minor": 0},
                   "agent_version": "0.1.0"})
    exec_ = hello + frame({"id": 1, "type": "stdout", "data": "aGVsbG8K"}) + \
        frame({"id": 1, "type": "stderr", "data": "b29wcwo="}) + \
        frame({"id": 1, "type": "exit", "code": 0, "signal": None, "timed_out": False,
               "truncated": False, "duration_us": 1, "stdout_bytes": 6, "stderr_bytes": 5})
    out("agent_frames", "exec", b"\x00" + exec_)
    read = hello + frame({"id": 1, "type": "file_data", "data": "aGVsbG8K", "offset": 0,
                          "size": 6, "eof": True})
    out("agent_frames", "read-file", b"\x01" + read)
    err = hello + frame({"id": 1, "type": "error", "code": "ENOENT", "errno": 2,
                         "message": "no such file"})
    out("agent_frames", "error", b"\x02" + err)
    write = hello + frame({"id": 1, "type": "written", "bytes": 4, "size": 4}) + \
        frame({"id": 2, "type": "pong"})
    out("agent_frames", "write", b"\x03" + write)


def control():
    for name, line in [("status", {"op": "status"}), ("pause", {"op": "pause"}),
                       ("snapshot", {"op": "snapshot", "path": "/s", "diff": True}),
                       ("hibernate", {"op": "hibernate", "path": "/h"}),
                       ("refusal", {"ok": False, "error": "x", "kind": "wrong_state"}),
                       ("restore", {"op": "restore", "snapshot": "/s"}),
                       ("set_balloon", {"op": "set_balloon", "target_mib": 64}),
                       ("balloon_stats", {"op": "balloon_stats"})]:
        out("control_protocol", name, json.dumps(line).encode())


virtqueue()
block()
vsock()
balloon()
header()
snapshots()
agent()
control()
