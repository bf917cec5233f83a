"""The receiver's band buffers: memory comes back only once no tensor views it, the free
list stays within its bound, and a lent segment goes back only to the process it was lent
to."""

from __future__ import annotations

import os

import pytest
import torch

from wavepp.handoff.buffers import BandBuffers


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_buffer_is_reused_only_after_its_last_view_is_gone():
    buffers = BandBuffers(keep_bytes=1 << 20)
    first = buffers.take(4096)
    where = _address(first)
    view = first[64:128].view(torch.float32)  # a band's tensor outlives the buffer's name
    del first
    other = buffers.take(4096)
    assert _address(other) != where  # still viewed: not handed out again
    view.fill_(1.0)
    del view
    again = buffers.take(4000)  # fits: at most its size, at least half of it
    assert _address(again) == where
    assert again.numel() == 4000


def test_the_free_list_keeps_at_most_keep_bytes_newest_first_and_sizes_that_fit():
    buffers = BandBuffers(keep_bytes=6000)
    a, b = buffers.take(4096), buffers.take(4096)
    where_b = _address(b)
    del a, b
    buffers.tidy()  # both do not fit in keep_bytes: the older one is let go
    small = buffers.take(1000)  # the kept 4096 is more than twice 1000: not used
    assert _address(small) != where_b
    big = buffers.take(4096)
    assert _address(big) == where_b
    assert _address(buffers.take(4096)) not in (where_b, _address(small))  # fresh memory


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_segment_is_lent_again_only_to_its_peer_and_their_number_is_bounded():
    clock = Clock()
    buffers = BandBuffers(keep_bytes=1 << 20, max_segments=2, idle_s=30.0, clock=clock)
    first, memory = buffers.lend(8192, peer=101)
    assert memory.fd >= 0 and first.numel() == 8192
    first[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # mapped, writable
    assert os.pread(memory.fd, 4, 0) == b"\x01\x02\x03\x04"  # the same memory as the file
    where = _address(first)
    del first
    other, _ = buffers.lend(8192, peer=202)  # another process: never the first's segment
    assert _address(other) != where and buffers.num_segments == 2
    again, _ = buffers.lend(6000, peer=101)  # its own, back
    assert _address(again) == where and buffers.num_segments == 2
    assert buffers.lend(8192, peer=303) is None  # two in use: the band goes on the socket
    assert _address(buffers.take(8192)) not in (where, _address(other))  # heap: apart
    del again
    # at the bound, a kept segment is not closed for another peer's band ...
    assert buffers.lend(8192, peer=303) is None and memory.fd >= 0
    clock.now = 29.0
    assert buffers.lend(8192, peer=303) is None
    clock.now = 30.0  # ... until it has been free for idle_s
    third, kept = buffers.lend(8192, peer=303)
    assert buffers.num_segments == 2 and memory.fd == -1 and kept.fd >= 0
    del third


def test_segments_open_stay_within_segment_bytes_and_a_kept_one_let_go_closes_its_file():
    clock = Clock()
    buffers = BandBuffers(keep_bytes=0, segment_bytes=12288, idle_s=30.0, clock=clock)
    tensor, memory = buffers.lend(8192, peer=7)
    fd = memory.fd
    assert buffers.lend(8192, peer=8) is None  # 16 KiB open would be over segment_bytes
    small, _ = buffers.lend(4096, peer=8)  # 12 KiB is not
    assert buffers.open_segment_bytes == 12288
    del tensor, small
    buffers.tidy()  # keep_bytes bounds heap memory only: both kept
    assert buffers.num_segments == 2
    again, same = buffers.lend(8000, peer=7)
    assert same is memory
    del again
    buffers.tidy()  # free since now (a receiver tidies every second)
    clock.now = 30.0
    buffers.tidy()  # free for idle_s: let go
    assert buffers.num_segments == 0 and buffers.open_segment_bytes == 0 and memory.fd == -1
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_spoiled_segment_is_closed_once_free_never_lent_again():
    """A segment whose sender never said it was done may still be written into."""
    buffers = BandBuffers(keep_bytes=1 << 20)
    tensor, memory = buffers.lend(4096, peer=7)
    memory.spoiled = True
    del tensor
    buffers.tidy()
    assert buffers.num_segments == 0 and memory.fd == -1
    clean, kept = buffers.lend(4096, peer=7)
    del clean
    buffers.tidy()
    assert buffers.num_segments == 1 and kept.fd >= 0  # a done segment is kept for reuse


def test_a_segment_in_use_when_the_buffers_close_is_closed_once_free():
    """A receiver that stopped serving: its bands' tensors may outlive it, and their
    segments close with them, not with the process."""
    buffers = BandBuffers(keep_bytes=1 << 20)
    tensor, memory = buffers.lend(4096, peer=7)
    kept, other = buffers.lend(4096, peer=8)
    del kept
    buffers.close()
    assert other.fd == -1 and memory.fd >= 0 and buffers.num_segments == 1
    del tensor
    assert memory.fd == -1 and buffers.num_segments == 0
