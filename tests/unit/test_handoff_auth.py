"""Who may send (issue 57): bands, pulls and decode requests signed with a shared secret
(HMAC-SHA256, fresh, never replayed), refused unsigned before any payload is read;
trusted peers (a Unix socket's user, or any peer the secret admitted) leave their
per-peer shares once admitted; a receiver keeps two runs' equal request ids apart."""

from __future__ import annotations

import os
import time

import anyio
import msgspec
import pytest

from tests.helpers.handoff_peers import (
    CONFIG,
    FP,
    SECRET,
    band,
    connect,
    exchange,
    in_thread,
    read_ack,
    serving,
    split,
)
from wavepp.handoff import auth, wire
from wavepp.handoff.auth import AuthError, Verifier, load_secret, sign_header, sign_message
from wavepp.handoff.client import DecodeRequest
from wavepp.handoff.receive import Receiver

OTHER = "127.0.0.2"


def header(rid: str = "r") -> wire.BandHeader:
    return wire.BandHeader(request_id=rid, stage=0, num_stages=1, fingerprint=FP, layers=[],
                           num_tokens=4, tensors=[])  # fmt: skip


# -- the signature ---------------------------------------------------------------------


def test_a_signed_header_verifies_once_and_only_with_its_secret():
    signed = sign_header(header(), SECRET)
    assert signed.auth.startswith("hmac-sha256:") and len(signed.auth) < 200
    Verifier(SECRET).header(signed)
    with pytest.raises(AuthError, match="does not verify"):
        Verifier(b"another secret, also 32 bytes..").header(signed)
    seen = Verifier(SECRET)
    seen.header(signed)
    with pytest.raises(AuthError, match="a replay"):
        seen.header(signed)


def test_every_field_is_covered_by_the_signature():
    signed = sign_header(header(), SECRET)
    for change in ({"request_id": "s"}, {"stage": 0, "num_stages": 2}, {"num_tokens": 5},
                   {"sender": "abc"}, {"first_token": 3}):  # fmt: skip
        with pytest.raises(AuthError, match="does not verify"):
            Verifier(SECRET).header(msgspec.structs.replace(signed, **change))


def test_unsigned_stale_and_malformed_signatures_are_refused():
    verifier = Verifier(SECRET)
    with pytest.raises(AuthError, match="unsigned band refused"):
        verifier.header(header())
    old = msgspec.structs.replace(header(), auth=auth.sign(
        SECRET, auth.BAND_DOMAIN, auth._band_body(header()), now=time.time() - 3600))
    with pytest.raises(AuthError, match="outside ±60 s"):
        verifier.header(old)
    with pytest.raises(AuthError, match="auth is not hmac-sha256"):
        verifier.header(msgspec.structs.replace(header(), auth="hmac-sha256:1:2:3"))


def test_a_pull_and_a_decode_request_sign_in_their_own_domains():
    pull = auth.sign_pull(wire.Pull("r", 0, FP), SECRET)
    Verifier(SECRET).pull(pull)
    request = sign_message(DecodeRequest("r", 4, sender="0123456789abcdef"), SECRET)
    Verifier(SECRET).message(request, "decode request")
    with pytest.raises(AuthError, match="decode request signature does not verify"):
        Verifier(SECRET).message(msgspec.structs.replace(request, max_tokens=5),
                                 "decode request")  # fmt: skip
    # a band's signature is no pull's: the same MAC under another domain fails
    forged = wire.Pull("r", 0, FP, auth=sign_header(header(), SECRET).auth)
    with pytest.raises(AuthError, match="does not verify"):
        Verifier(SECRET).pull(forged)


def test_the_secret_comes_from_a_file_else_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert load_secret(str(path), {}) == SECRET
    assert load_secret(None, {"WAVEPP_HANDOFF_SECRET": "x" * 20}) == b"x" * 20
    assert load_secret(None, {}) is None
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match=r"is 5 bytes; it needs 16\.\.4096"):
        load_secret(str(path), {})
    with pytest.raises(ValueError, match="cannot read the handoff secret"):
        load_secret(str(tmp_path / "missing"), {})


# -- a receiver with the secret ----------------------------------------------------------


def test_a_receiver_with_the_secret_refuses_unsigned_bands_before_their_payload():
    receiver = Receiver(CONFIG, "float32", secret=SECRET)

    async def main():
        async with serving(receiver) as address:

            def send():
                head, _ = split(band("u", 0, 1))
                with connect(address) as sock:  # the header alone: no payload is awaited
                    sock.sendall(head)
                    unsigned = read_ack(sock)
                wrong = exchange(address, band("w", 0, 1, secret=b"x" * 32))
                signed = exchange(address, band("s", 0, 1, secret=SECRET))
                return unsigned, wrong, signed

            return await in_thread(send)

    unsigned, wrong, signed = anyio.run(main)
    assert not unsigned.ok and unsigned.error.startswith("unsigned band refused")
    assert not wrong.ok and "does not verify" in wrong.error
    assert signed.ok, signed
    assert receiver.counts["bands_refused"] == 2 and receiver.held_bytes > 0
    assert receiver.pending() == {}


def test_a_trusted_peer_leaves_its_connection_share_once_admitted():
    """With the secret, a peer's admitted connections stop counting against its share:
    a server's many bands and decodes are never turned away as one peer's; without it
    a TCP peer's connections count to their end."""

    def run(secret):
        receiver = Receiver(CONFIG, "float32", max_peer_connections=1, secret=secret)

        async def main():
            async with serving(receiver) as address:

                def two():
                    first = band("a", 0, 2, secret=secret)
                    head, payload = split(first)
                    with connect(address, OTHER) as held:  # admitted, its payload unsent
                        held.sendall(head + payload[:8])
                        time.sleep(0.3)
                        second = exchange(address, band("b", 0, 1, secret=secret), OTHER)
                        held.sendall(payload[8:])
                        return second, read_ack(held)

                return await in_thread(two)

        return anyio.run(main)

    second, first = run(SECRET)
    assert second.ok and first.ok, (second, first)
    second, first = run(None)
    assert not second.ok and second.error.endswith("at most 1 per peer") and first.ok


def test_a_unix_peer_is_trusted_once_admitted(tmp_path):
    receiver = Receiver(CONFIG, "float32", max_peer_connections=1, max_peer_requests=1)
    where = wire.Address("unix", path=str(tmp_path / "r.sock"))

    async def main():
        async with serving(receiver, where) as address:

            def two():
                head, payload = split(band("a", 0, 2))
                with connect(address) as held:
                    held.sendall(head)
                    time.sleep(0.3)
                    second = exchange(address, band("b", 0, 2))  # a second incomplete one too
                    held.sendall(payload)
                    return second, read_ack(held)

            return await in_thread(two)

    second, first = anyio.run(main)
    assert second.ok and first.ok, (second, first)
    assert sorted(receiver.pending()) == ["a", "b"]


def test_two_runs_equal_ids_never_meet():
    """A decoder shared by two servers, or outliving a restart: run B's request "a" is
    not "already complete" because run A's was; each waits for its own."""
    receiver = Receiver(CONFIG, "float32")
    run_a, run_b = "0123456789abcdef", "fedcba9876543210"

    async def main():
        async with serving(receiver) as address:
            first = await in_thread(exchange, address, band("a", 0, 1, sender=run_a))
            taken = await receiver.wait("a", 5, sender=run_a)
            again = await in_thread(exchange, address, band("a", 0, 1, sender=run_a))
            other = await in_thread(exchange, address, band("a", 0, 1, sender=run_b))
            theirs = await receiver.wait("a", 5, sender=run_b)
            return first, taken, again, other, theirs

    first, taken, again, other, theirs = anyio.run(main)
    assert first.ok and taken.sender == run_a and taken.request_id == "a"
    assert not again.ok and "already complete" in again.error
    assert other.ok and theirs.sender == run_b
    with pytest.raises(msgspec.ValidationError):  # a sender holds no '/'
        msgspec.msgpack.decode(msgspec.msgpack.encode(
            {"request_id": "a", "max_tokens": 1, "sender": "a/b"}), type=DecodeRequest)


def test_a_payload_slower_than_the_floor_is_cut(monkeypatch):
    from wavepp.handoff import receive

    monkeypatch.setattr(receive, "MIN_PAYLOAD_BYTES_PER_S", 64)  # this band: ~2 s at most
    receiver = Receiver(CONFIG, "float32", header_timeout_s=0.2, incomplete_timeout_s=50)

    async def main():
        async with serving(receiver) as address:

            def crawl():
                with connect(address) as sock:
                    sock.sendall(head)
                    started = time.monotonic()
                    for byte in payload:
                        try:
                            sock.send(bytes([byte]))
                        except OSError:
                            break
                        time.sleep(0.05)
                        if time.monotonic() - started > 20:
                            break
                    return read_ack(sock), time.monotonic() - started

            return await in_thread(crawl)

    head, payload = split(band("c", 0, 2))
    ack, seconds = anyio.run(main)
    assert ack is not None and not ack.ok, ack
    assert ack.error == f"a band of {len(payload):,} bytes came slower than 64 bytes/s"
    assert seconds < 15 and receiver.held_bytes == 0 and receiver.pending() == {}


def test_a_secret_shorter_than_sixteen_bytes_is_refused_by_the_worker_cli(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "s"
    path.write_text("short")
    done = subprocess.run([sys.executable, "-m", "wavepp.decode", "--model", str(tmp_path),
                           "--listen", f"unix:{tmp_path}/d.sock", "--handoff-secret", str(path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert done.returncode == 2
    assert "--handoff-secret: the handoff secret" in done.stderr and "16..4096" in done.stderr
