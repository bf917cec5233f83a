"""Transport: the rounds plane and the data-plane links between ranks (DESIGN §3, §10).

- ``planes``: frames and their checks, and both planes over ``torch.distributed`` (Gloo);
- ``unix``: the rounds plane and links over Unix sockets, for ranks that share one host;
- ``watchdog``: heartbeats beside the planes, naming a dead or hung rank.
"""
