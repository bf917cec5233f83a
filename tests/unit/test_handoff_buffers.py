"""The receiver's band buffers: memory comes back only once no tensor views it, and the
free list stays within its bound."""

from __future__ import annotations

import torch

from wavepp.handoff.receive import BandBuffers


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
