"""The fleet launcher: ``python -m wavepp.fleet`` starts N pipelines and a router on one
node (``__main__``, ``docs/fleet.md``). The KV events the replicas publish and the router
indexes are ``wavepp.kv_events``.
"""
