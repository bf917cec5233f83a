"""Where a simulated run's stages sit, and the time their activations take between them.

Stage ``s`` of a run of P stages over ``tp`` devices each holds devices ``s·tp ..
s·tp + tp - 1``; devices fill nodes of ``gpus_per_node`` in order. A stage's
all-reduces stay inside its node (``node_link``); its activations go to the next stage
over ``node_link`` when both stages share a node, else over ``network_link`` (each of
its devices to its peer in the next stage, in parallel, one NIC each).
``--sim-link NAME`` puts every stage-to-stage transfer on NAME instead.

The runtime overlaps a transfer exactly as :class:`SimulatedLink` models it: a stage's
worker hands each wave's activations to its sender task and goes on to the next wave
(``wavepp.runtime.followers.follow_waves``; rank 0's ``StageZero.run``), and the sender
sends them in order, one at a time. So the transfer of wave k overlaps the compute of
wave k+1 on the sending stage, transfers queue behind one another on the link, and the
next stage starts wave k when the whole of it has arrived.
"""

from __future__ import annotations

import anyio
import attrs
import torch

from wavepp.sim.profiles import LINKS, DeviceProfile, LinkProfile
from wavepp.transport.base import Link
from wavepp.transport.frames import DataLimits


@attrs.frozen
class Topology:
    """The devices of a run of ``stages`` stages over ``tp`` devices each."""

    device: DeviceProfile
    stages: int
    tp: int = 1
    link: str | None = None  # --sim-link: every stage-to-stage transfer over this link

    def __attrs_post_init__(self) -> None:
        nodes = self.device.gpus_per_node
        if self.tp < 1 or nodes % self.tp:
            raise ValueError(
                f"--sim-tp {self.tp}: a tensor-parallel stage must fit a node of "
                f"{self.device.name} and tile it ({nodes} GPUs per node); use a divisor of "
                f"{nodes}"
            )
        if self.link is not None and self.link not in LINKS:
            raise ValueError(f"--sim-link {self.link!r} unknown; one of {sorted(LINKS)}")

    @property
    def tp_link(self) -> LinkProfile:
        return LINKS[self.device.node_link]

    def stage_link(self, stage: int) -> LinkProfile:
        """The link from ``stage`` to ``stage + 1``."""
        if self.link is not None:
            return LINKS[self.link]
        nodes = self.device.gpus_per_node
        same = (stage * self.tp) // nodes == ((stage + 1) * self.tp) // nodes
        return LINKS[self.device.node_link if same else self.device.network_link]

    def describe(self) -> str:
        hops = [self.stage_link(s).name for s in range(self.stages - 1)]
        links = ", ".join(f"{s}->{s + 1} {name}" for s, name in enumerate(hops))
        tp = f"; each stage's all-reduces over {self.tp_link.name}" if self.tp > 1 else ""
        return (f"{self.stages} stage(s) x {self.tp} {self.device.name} "
                f"({self.device.gpus_per_node} per node){tp}"
                + (f"; activations {links}" if links else ""))  # fmt: skip


class SimulatedLink:
    """A data-plane link whose activation messages first take the time their bytes need
    over ``profile``: ``tokens`` rows of ``row_bytes`` (d_model activations), for the
    ``[tokens]`` stand-in the simulated executor sends. The wait sits in ``send``, which
    only the stage's sender task calls, so it overlaps the stage's next wave as a real
    transfer does."""

    def __init__(self, inner: Link, profile: LinkProfile, row_bytes: int,
                 time_scale: float) -> None:  # fmt: skip
        self.inner = inner
        self.profile = profile
        self.row_bytes = row_bytes
        self.time_scale = time_scale
        self.kind = inner.kind
        self.src = inner.src
        self.dst = inner.dst

    def transfer_s(self, tokens: int) -> float:
        """Simulated seconds one wave of ``tokens`` rows takes over the link."""
        return self.profile.transfer_s(tokens * self.row_bytes)

    async def send(self, descriptor: bytes, tensor: torch.Tensor | None) -> None:
        if tensor is not None and tensor.shape[0]:
            await anyio.sleep(self.transfer_s(tensor.shape[0]) * self.time_scale)
        await self.inner.send(descriptor, tensor)

    async def recv(self, max_bytes: int | None = None) -> tuple[bytes, torch.Tensor | None]:
        return await self.inner.recv(max_bytes)

    def set_limits(self, limits: DataLimits) -> None:
        self.inner.set_limits(limits)
