"""Distinct names for distinct ids."""

from typing import NewType

BlockHash = NewType("BlockHash", int)
"""Chained 64-bit hash of a whole prefix ending at one block; equal hash ⇒ equal prefix."""

RequestId = NewType("RequestId", str)
"""A request's id as the client gave it."""

SlotId = NewType("SlotId", int)
"""Index of one block-sized slot in a stage's KV pool, in ``0..capacity-1``."""

NodeId = NewType("NodeId", int)
"""Index of one segment node in a stage's cache tree; 0 is the root (no blocks)."""

ROOT = NodeId(0)
