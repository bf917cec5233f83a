"""Handing a request's cache on: the wire format of a stage's band (``wire``), the
receiving side (``receive``), the ``transformers`` cache built from it (``hf``) and the
decode worker's client (``client``). Imports nothing of WavePP's runtime: a decode engine
can use it alone. ``docs/handoff.md`` is the contract.
"""

from wavepp.handoff.wire import (
    ACK_MAGIC,
    ACK_PREFIX_BYTES,
    BAND_MAGIC,
    DTYPES,
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    WIRE_VERSION,
    Ack,
    Address,
    BandHeader,
    Fingerprint,
    TensorSpec,
    WireError,
    ack_length,
    band_bytes,
    decode_ack,
    decode_header,
    encode_ack,
    encode_band_prefix,
    expected_tensors,
    fingerprint_from_hf_config,
    header_length,
    parse_address,
)

__all__ = [
    "ACK_MAGIC",
    "ACK_PREFIX_BYTES",
    "BAND_MAGIC",
    "DTYPES",
    "MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "WIRE_VERSION",
    "Ack",
    "Address",
    "BandHeader",
    "Fingerprint",
    "TensorSpec",
    "WireError",
    "ack_length",
    "band_bytes",
    "decode_ack",
    "decode_header",
    "encode_ack",
    "encode_band_prefix",
    "expected_tensors",
    "fingerprint_from_hf_config",
    "header_length",
    "parse_address",
]
