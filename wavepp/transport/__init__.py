"""Transport: the rounds plane and the data-plane links between ranks (DESIGN §3, §10).

- ``base``: the ``Link`` protocol (what a data-plane link does) and ``PlaneError``; the
  rounds plane's protocol is ``wavepp.rounds.plane.RoundsPlane``;
- ``frames``: every wire format and its checks, made before anything is allocated;
- ``gloo``: both planes over ``torch.distributed`` (Gloo; NCCL for activations on GPUs);
- ``unix``: both planes over Unix sockets, for ranks that share one host;
- ``planes``: ``build_planes``, which picks and builds this rank's planes;
- ``watchdog``: heartbeats beside the planes (over the rendezvous store), naming a dead
  or hung rank; ``processes``: whether a peer's process on this machine still runs.
"""
