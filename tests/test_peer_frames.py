"""A Raft link's frame buffers (raftstore/peer_frames.py): whatever pieces the bytes arrive in
or leave in, the frames come out whole, in order, byte for byte pysyncobj's; a frame past the
bound is refused before it is buffered; a long frame's buffer is let go once it is parsed."""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raftstore.peer_frames import INBOX_INITIAL_BYTES, LENGTH, FrameTooLong, Inbox, Outbox

pytestmark = pytest.mark.property

_frames = st.lists(st.binary(max_size=3000), max_size=12)


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(LENGTH.pack(len(frame)) + frame for frame in frames)


def _take_all(inbox: Inbox) -> list[bytes]:
    taken = []
    while (frame := inbox.take()) is not None:
        taken.append(bytes(frame))
        frame.release()
    return taken


@given(frames=_frames, cuts=st.lists(st.integers(min_value=1, max_value=5000), max_size=40))
@settings(max_examples=300, deadline=None)
def test_frames_come_out_whole_whatever_pieces_they_arrive_in(
    frames: list[bytes], cuts: list[int]
) -> None:
    wire = _wire(frames)
    inbox, taken, position = Inbox(frame_max=1 << 20), [], 0
    for cut in [*cuts, len(wire)]:
        piece = wire[position : position + cut]
        position += len(piece)
        inbox.feed(piece)
        if cut % 3 == 0:  # sometimes parse between pieces, as pysyncobj does between polls
            taken += _take_all(inbox)
    taken += _take_all(inbox)
    assert taken == frames
    assert len(inbox) == 0


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=3 * INBOX_INITIAL_BYTES), max_size=6),
    chunk=st.sampled_from([1000, 65_536, 300_000]),
)
@settings(max_examples=40, deadline=None)
def test_frames_longer_than_the_buffer_are_received_in_place(sizes: list[int], chunk: int) -> None:
    frames = [bytes([n % 251]) * size for n, size in enumerate(sizes)]
    wire = _wire(frames)
    inbox, taken = Inbox(frame_max=1 << 22), []
    for position in range(0, len(wire), chunk):
        inbox.feed(wire[position : position + chunk])
        taken += _take_all(inbox)
    assert taken == frames


def test_a_declared_length_past_the_bound_is_refused_before_its_bytes() -> None:
    inbox = Inbox(frame_max=1000)
    with pytest.raises(FrameTooLong, match="declared frame length 1001"):
        inbox.feed(LENGTH.pack(1001))
    with pytest.raises(FrameTooLong, match="declared frame length -1"):
        Inbox(frame_max=1000).feed(LENGTH.pack(-1))


def test_more_than_two_frames_unparsed_is_refused() -> None:
    inbox = Inbox(frame_max=100)
    frame = LENGTH.pack(100) + b"x" * 100
    inbox.feed(frame + frame)
    with pytest.raises(FrameTooLong, match="bytes unparsed"):
        inbox.feed(b"\x00" * 20)


def test_a_long_frames_buffer_is_let_go_once_parsed_and_a_short_one_kept() -> None:
    inbox = Inbox(frame_max=1 << 24, keep_bytes=1 << 20)
    inbox.feed(_wire([b"y" * (4 << 20)]))
    assert inbox.capacity > 4 << 20
    assert _take_all(inbox) == [b"y" * (4 << 20)]
    inbox.feed(_wire([b"z"]))
    assert inbox.capacity == INBOX_INITIAL_BYTES
    inbox.feed(_wire([b"w" * (512 << 10)]))
    grown = inbox.capacity
    _take_all(inbox)
    inbox.feed(_wire([b"v"]))
    assert inbox.capacity == grown  # within keep_bytes: reused, never allocated again


@given(frames=_frames, bodies=st.lists(st.integers(min_value=1, max_value=4), max_size=12))
@settings(max_examples=100, deadline=None)
def test_outbox_sends_the_same_bytes_as_pysyncobjs_joined_frames(
    frames: list[bytes], bodies: list[int]
) -> None:
    outbox = Outbox()
    for number, frame in enumerate(frames):
        pieces = max(1, bodies[number % len(bodies)] if bodies else 1)
        step = max(1, len(frame) // pieces)
        outbox.add_frame([frame[i : i + step] for i in range(0, len(frame), step)] or [b""])
    expected = _wire(frames)
    assert len(outbox) == len(expected)
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many partial sends
    received = bytearray()

    def read() -> None:
        while chunk := receiver.recv(1 << 16):
            received.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        while len(outbox):
            outbox.send(sender)
    finally:
        sender.close()
        reader.join(timeout=10)
        receiver.close()
    assert bytes(received) == expected


def test_a_frame_of_many_mebibytes_goes_out_in_pieces_without_joining() -> None:
    outbox = Outbox()
    head, body = b"h" * 20, b"b" * (3 << 20)
    outbox.add_frame([head, body])
    sender, receiver = socket.socketpair()
    sender.setblocking(False)
    sent = outbox.send(sender)  # the kernel takes what fits; the rest stays queued
    assert 0 < sent <= LENGTH.size + len(head) + len(body)
    assert len(outbox) == LENGTH.size + len(head) + len(body) - sent
    sender.close()
    receiver.close()
