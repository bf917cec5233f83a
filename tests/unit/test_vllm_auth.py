"""The connector's side of the stages' shared secret (``wavepp.handoff.auth``), without
vLLM: where the secret comes from (``kv_connector_extra_config.secret_file``, else
``$WAVEPP_HANDOFF_SECRET``), pulls signed with it, and every band's header checked
against it before any of the band is handed on — a band unsigned, signed with another
key or replayed is refused (a load error: ``kind`` ``auth``) with nothing taken; a stage
with a secret refuses an unsigned pull (``kind`` ``refused``)."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from tests.helpers.fake_stage import FakeStage
from wavepp.handoff import auth, wire
from wavepp.handoff.client import build_band
from wavepp.handoff.gate import Gate
from wavepp.vllm import plan
from wavepp.vllm.pulling import PullFailed, PullRefused, pull_band

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
    "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 512, "intermediate_size": 256,
}  # fmt: skip
FP = wire.fingerprint_from_hf_config(LLAMA, "float32")
SECRET = b"the stages' secret, 32 bytes...."
OTHER = b"another secret of 32 bytes......"
TOKENS = list(range(3, 43))


def _band(rid: str) -> tuple[wire.BandHeader, list[torch.Tensor]]:
    t = len(TOKENS)
    tensors = {(-1, "tokens"): torch.tensor(TOKENS, dtype=torch.int32)}
    for layer in (0, 1):
        for name in ("k", "v"):
            tensors[(layer, name)] = torch.full((t, 2, 32), float(layer))
    return build_band(rid, 0, 1, FP, tensors, t, first_token=1)


def test_the_secret_comes_from_the_extra_config_file_else_the_environment(tmp_path):
    assert plan.read_settings({}, {}).secret is None
    assert plan.read_settings(None, {auth.SECRET_ENV: SECRET.decode()}).secret == SECRET
    path = tmp_path / "secret"
    path.write_bytes(OTHER + b"\n")  # a trailing newline is not the secret's
    got = plan.read_settings({"secret_file": str(path)}, {auth.SECRET_ENV: SECRET.decode()})
    assert got.secret == OTHER and OTHER.decode() not in repr(got)
    with pytest.raises(ValueError, match="WavePPConnector: cannot read the handoff secret"):
        plan.read_settings({"secret_file": str(tmp_path / "none")}, {})
    with pytest.raises(ValueError, match=r"\$WAVEPP_HANDOFF_SECRET\) is 5 bytes; it needs 16"):
        plan.read_settings({}, {auth.SECRET_ENV: "short"})


def test_the_extra_config_is_read_strictly_with_one_host_defaults():
    got = plan.read_settings({"timeout_s": 5, "allow": ["*"]}, {})
    assert got.timeout_s == 5.0 and got.allow == ("*",) and got.threads == 8
    assert plan.read_settings({}, {}).allow == plan.DEFAULT_ALLOW
    assert plan.read_settings({}, {}).max_band_bytes == 4096 << 20
    with pytest.raises(ValueError, match=r"unknown field `colour`.*it takes"):
        plan.read_settings({"colour": "blue"}, {})
    with pytest.raises(ValueError, match=r"Expected `float`.*\$.timeout_s"):
        plan.read_settings({"timeout_s": "soon"}, {})
    with pytest.raises(ValueError, match=r"Expected `int` >= 1 - at `\$.threads`"):
        plan.read_settings({"threads": 0}, {})


def test_signed_pulls_and_bands_pass_and_every_other_band_is_refused_before_its_payload(
    tmp_path,
):
    replayed = _band("replayed")
    replayed = (auth.sign_header(replayed[0], SECRET), replayed[1])  # the same header twice
    forged = _band("forged")
    forged = (auth.sign_header(forged[0], OTHER), forged[1])  # another key's
    bands = {"ok": _band("ok"), "replayed": replayed, "forged": forged}
    stage = FakeStage(tmp_path / "signed.sock", bands, secret=SECRET)
    plain = FakeStage(tmp_path / "plain.sock", {"plain": _band("plain")})
    verifier = auth.Verifier(SECRET)
    gate = Gate(LLAMA, "float32", FP, 1 << 30)
    taken = []

    def pull(where: FakeStage, rid: str, secret: bytes | None = SECRET) -> wire.BandHeader:
        frame = auth.sign_pull(wire.Pull(rid, 0, FP), secret)
        return pull_band(where.address, frame, gate, num_stages=1, num_tokens=len(TOKENS),
                         take=lambda s, t: taken.append((s.layer, s.name)),
                         deadline=time.monotonic() + 30, verify=verifier.header)  # fmt: skip

    try:
        header = pull(stage, "ok")
        assert header.auth.startswith("hmac-sha256:") and len(taken) == 5
        taken.clear()
        assert pull(stage, "replayed").auth == replayed[0].auth  # its first time: taken
        taken.clear()
        with pytest.raises(PullFailed, match="band signature seen before: a replay") as e:
            pull(stage, "replayed")
        assert e.value.kind == "auth"
        with pytest.raises(PullFailed, match="band signature does not verify") as e:
            pull(stage, "forged")
        assert e.value.kind == "auth"
        with pytest.raises(PullFailed, match="unsigned band refused") as e:
            pull(plain, "plain")
        assert e.value.kind == "auth"
        assert taken == []  # nothing of a band that failed its signature was handed on
        # the stage refuses a pull that is unsigned, or signed with another key
        with pytest.raises(PullRefused, match="unsigned pull refused") as e:
            pull(stage, "ok", secret=None)
        assert e.value.kind == "refused"
        with pytest.raises(PullRefused, match="pull signature does not verify"):
            pull(stage, "ok", secret=OTHER)
        assert taken == [] and stage.counts["pulls refused"] == 2
        deadline = time.monotonic() + 10  # hang guard: the refusals' acks arrive
        while len(stage.acks) + len(plain.acks) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        refusals = [a.error for a in stage.acks + plain.acks if not a.ok]
        assert len(refusals) == 3 and all("signature" in r or "unsigned" in r for r in refusals)
    finally:
        stage.close()
        plain.close()


def test_a_signature_covers_the_whole_header():
    """A signed header changed in any field (here the token count the band claims)
    does not verify: the payload's shapes cannot be swapped under a signature."""
    header = auth.sign_header(_band("h")[0], SECRET)
    verifier = auth.Verifier(SECRET)
    with pytest.raises(auth.AuthError, match="does not verify"):
        verifier.header(msgspec.structs.replace(header, num_tokens=41))
    verifier.header(header)
