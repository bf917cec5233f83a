"""A tensor-parallel rank killed (SIGKILL) or stopped (SIGSTOP) mid-run, 2 stages x TP 2
(four ranks). Offline, under plain torchrun: every other rank names it by stage and TP
rank on its own stderr, prints no traceback, and exits; torchrun exits non-zero. Under
the server: every client not answered 200 gets the JSON 503 naming the rank (not
Gloo's words), every other rank names it, no traceback from WavePP's code, and the
launcher exits non-zero. The bounds are hang guards only."""

import json
import signal

import pytest

from tests.helpers.faults import break_a_rank, break_a_serving_rank
from tests.helpers.run import OUR_FRAME

pytestmark = pytest.mark.slow

OPTIONS = ("--tp", "2", "--model", "tiny-llama", "--requests", "400", "--prompt-tokens", "512",
           "--dead-after-s", "5")  # fmt: skip
NAMES = {1: "rank 1 (stage 0, TP rank 1)", 2: "rank 2 (stage 1, TP rank 0)",
         3: "rank 3 (stage 1, TP rank 1)"}  # fmt: skip
# a traceback through WavePP's own code (torchrun's summary of a failed child is its own)


@pytest.mark.parametrize("victim", [1, 2, 3], ids=["follower-0", "leader-1", "follower-1"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_a_broken_tp_rank_is_named_by_every_rank(tmp_path, victim, sig):
    broken = break_a_rank(tmp_path, 4, OPTIONS, victim, sig)
    assert broken.rc != 0
    assert sorted(broken.exits) == sorted({0, 1, 2, 3} - {victim}), broken.logs
    print(f"{sig.name} rank {victim}: others exited after "
          f"{', '.join(f'{r}: {t:.1f} s' for r, t in sorted(broken.exits.items()))}")
    for rank in sorted(broken.exits):
        said = broken.said(rank)
        assert NAMES[victim] in said, (rank, said[-3000:])
        assert "Traceback" not in said, (rank, said[-6000:])
        assert "pair.cc" not in said, (rank, said[-3000:])  # Gloo's text, not ours


@pytest.mark.parametrize("victim,sig", [(1, signal.SIGKILL), (2, signal.SIGKILL),
                                        (1, signal.SIGSTOP), (2, signal.SIGSTOP)],
                         ids=["kill-follower", "kill-leader", "stop-follower", "stop-leader"])
def test_a_broken_tp_rank_fails_the_server_with_a_json_503(tmp_path, victim, sig):
    options = ("--tp", "2", "--model", "tiny-llama", "--block-size", "16",
               "--capacity-blocks", "256", "--dead-after-s", "5")  # fmt: skip
    broken = break_a_serving_rank(tmp_path, 4, options, victim, sig)
    text = broken.text
    assert broken.rc != 0, text[-3000:]
    assert not OUR_FRAME.search(text), text[-6000:]
    assert "Exception in ASGI" not in text and "pair.cc" not in text, text[-3000:]
    errors = [a for a in broken.answers if a[0] not in (200, None)]
    assert errors, broken.answers[-3:]
    for status, kind, body in errors:  # the API's JSON error, naming the rank
        assert status == 503 and kind.startswith("application/json"), body
        assert NAMES[victim] in json.loads(body)["error"]["message"], body
    for rank in {0, 1, 2, 3} - {victim}:
        said = [line for line in text.splitlines() if line.startswith(f"[wavepp rank {rank}]")]
        assert any(NAMES[victim] in line for line in said), (rank, text[-4000:])
    assert NAMES[victim] in text.strip().splitlines()[-1]  # the launcher's last line
