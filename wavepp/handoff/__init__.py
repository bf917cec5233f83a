"""Handing a request's cache on, both sides; ``docs/handoff.md`` is the contract.

- the wire format of a stage's band (``wire``, pure) and the sockets it goes over
  (``_io``);
- sending: a stage's one sender (``send``), the seam between it and each transport
  (``base``), WavePP's wire over a socket (``socket_send``) and the stage's band server
  where decoders pull (``pull``);
- receiving: the server (``receive``, which reads each band into a recycled buffer) and
  the band's way through it — checked before anything is allocated (``gate``), claimed
  and assembled (``assembly``); the ``transformers`` cache built from a request's bands
  (``hf``) and the decode worker's client (``client``).

The receiving side imports nothing else of WavePP: a decode engine can use it alone. The
sending side takes its outcome message and ids from ``wavepp.rounds`` and
``wavepp.state``. This module exports the wire's names only (no torch).
"""

from wavepp.handoff.wire import (
    ACK_MAGIC,
    ACK_PREFIX_BYTES,
    BAND_MAGIC,
    DTYPES,
    MAX_HEADER_BYTES,
    MAX_PULL_BYTES,
    PREFIX_BYTES,
    PULL_MAGIC,
    PULL_PREFIX_BYTES,
    PULL_TARGET,
    PULL_VERSION,
    WIRE_VERSION,
    Ack,
    Address,
    BandHeader,
    Fingerprint,
    Pull,
    TensorSpec,
    WireError,
    ack_length,
    band_bytes,
    decode_ack,
    decode_header,
    decode_pull,
    encode_ack,
    encode_band_prefix,
    encode_pull,
    expected_tensors,
    fingerprint_from_hf_config,
    fingerprint_mismatch,
    header_length,
    parse_address,
    parse_target,
    payload_layout,
    pull_length,
)

__all__ = [
    "ACK_MAGIC",
    "ACK_PREFIX_BYTES",
    "BAND_MAGIC",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "MAX_PULL_BYTES",
    "PREFIX_BYTES",
    "PULL_MAGIC",
    "PULL_PREFIX_BYTES",
    "PULL_TARGET",
    "PULL_VERSION",
    "WIRE_VERSION",
    "Ack",
    "Address",
    "BandHeader",
    "Fingerprint",
    "Pull",
    "TensorSpec",
    "WireError",
    "ack_length",
    "band_bytes",
    "decode_ack",
    "decode_header",
    "decode_pull",
    "encode_ack",
    "encode_band_prefix",
    "encode_pull",
    "expected_tensors",
    "fingerprint_from_hf_config",
    "fingerprint_mismatch",
    "header_length",
    "parse_address",
    "parse_target",
    "payload_layout",
    "pull_length",
]
