"""Rank 0's request table and intake: a request's moves, the checks made once at intake
with their rejection reasons, and what a server keeps of ended requests."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from wavepp.runtime.intake import Intake
from wavepp.runtime.records import RequestRejected, Status, StatusError
from wavepp.runtime.table import RequestTable
from wavepp.workload import RequestSpec


def book(retain_ended: int | None = None, vocab: int | None = 100, capacity: int = 10):
    table = RequestTable(lambda line: None, retain_ended=retain_ended)
    return table, Intake(table, 4, capacity, vocab)


def spec(rid: str, tokens=None) -> RequestSpec:
    return RequestSpec(rid, np.arange(8, dtype=np.int32) if tokens is None else tokens, False, 0)


def run(fn) -> None:
    async def main() -> None:
        with anyio.fail_after(30):  # a hang guard
            fn()

    anyio.run(main)


def test_a_request_moves_through_its_life_and_only_forward():
    def main() -> None:
        table, intake = book()
        record = intake.submit(spec("a"))
        assert record.status is Status.QUEUED and table.num_unfinished == 1
        with pytest.raises(StatusError):  # a queued request cannot start running
            table.started("a", 0.0)
        table.waiting.remove("a")
        table.admitted("a", 1.0)
        table.started("a", 2.0)
        table.started("a", 3.0)  # later chunks leave it running
        assert (record.status, record.first_chunk_at) == (Status.RUNNING, 2.0)
        table.finish("a", 4, 7, 1.5)
        assert record.status is Status.DONE and record.finished.is_set()
        assert record.result().status == "done" and record.result().first_token == 7
        with pytest.raises(StatusError):
            record.admit(5.0)
        table.finish("a", 4, 7, 1.5)  # a late duplicate of an ended request is ignored
        assert table.totals["done"] == 1 and table.num_unfinished == 0

    run(main)


def test_a_cancel_is_noted_once_and_settles_as_cancelled():
    def main() -> None:
        table, intake = book()
        record = intake.submit(spec("a"))
        assert table.ask_cancel("a", "client went away") is record
        assert table.ask_cancel("a", "again") is None  # already asked
        table.waiting.remove("a")
        table.settle_cancel("a")
        assert record.status is Status.CANCELLED and record.error == "client went away"
        assert table.ask_cancel("a", "late") is None  # over

    run(main)


def test_a_first_token_before_the_cancel_reached_a_stage_wins():
    def main() -> None:
        table, intake = book()
        record = intake.submit(spec("a"))
        table.waiting.remove("a")
        table.admitted("a", 0.0)
        table.started("a", 0.0)
        table.ask_cancel("a", "cancelled")
        table.finish("a", 0, 3, 0.5)
        assert record.status is Status.DONE and record.error is None and not record.cancelled

    run(main)


def test_a_handoff_cancelled_midway_ends_cancelled_even_if_every_outcome_came_first():
    """Stages send their bands' outcomes straight to rank 0 (``HandoffRelay``), so they
    may overtake the wave that confirms a cancel: the request still ends as cancelled,
    when the stages confirm it."""
    from wavepp.rounds.messages import HandoffOutcome

    def main() -> None:
        table = RequestTable(lambda line: None, num_stages=2)
        intake = Intake(table, 4, 10, 100, handoff_target=lambda spec: "unix:/nowhere")
        records = {}
        for rid in ("a", "b"):
            records[rid] = intake.submit(RequestSpec(rid, np.arange(8, dtype=np.int32), False,
                                                     0, handoff=True))  # fmt: skip
            table.waiting.remove(rid)
            table.admitted(rid, 0.0)
            table.started(rid, 0.0)
            table.finish(rid, 0, 3, 0.5)
            assert records[rid].status is Status.HANDING_OFF
        table.ask_cancel("a", "client went away")
        # a peer's outcome for a stage the run does not have counts for nothing
        table.handoff_settled(HandoffOutcome("b", 5, True, "", "", 0, 0.01))
        table.handoff_settled(HandoffOutcome("b", 0, True, "", "", 0, 0.01))
        assert records["b"].status is Status.HANDING_OFF
        for rid, ok in (("a", False), ("b", True)):
            for stage in (0, 1):
                table.handoff_settled(HandoffOutcome(rid, stage, ok, "" if ok else "cancelled",
                                                     "", 0, 0.01))  # fmt: skip
        assert records["b"].status is Status.DONE  # no cancel: its last outcome ends it
        assert records["a"].status is Status.HANDING_OFF  # the stages' confirmation ends it
        table.settle_cancel("a")
        assert records["a"].status is Status.CANCELLED
        assert records["a"].error == "client went away"

    run(main)


@pytest.mark.parametrize("order", ["token first", "outcomes first"])
def test_a_cancel_that_stopped_a_band_ends_the_request_cancelled_though_its_token_came(order):
    """A cancel asked during the last chunk: stage 0 drops the request at once (its band
    ends "cancelled") while the last stage still computes the first token, which clears
    the cancel as too late for the prefill. The last stage's band, acknowledged before
    the cancel reached it, may report before the stages confirm the cancel: the request
    still ends cancelled. A cancel that stopped no band came too late: done. A
    "cancelled" outcome with no cancel asked (a peer's bytes) waits for nothing: done."""
    from wavepp.rounds.messages import HandoffOutcome

    def main() -> None:
        table = RequestTable(lambda line: None, num_stages=2)
        intake = Intake(table, 4, 10, 100, handoff_target=lambda spec: "unix:/nowhere")
        records = {}
        for rid in ("stopped", "too late", "peer"):
            records[rid] = intake.submit(RequestSpec(rid, np.arange(8, dtype=np.int32), False,
                                                     0, handoff=True))  # fmt: skip
            table.waiting.remove(rid)
            table.admitted(rid, 0.0)
            table.started(rid, 0.0)
        table.ask_cancel("stopped", "client went away")
        table.ask_cancel("too late", "client went away")
        stage0 = {"stopped": (False, "cancelled"), "too late": (True, ""),
                  "peer": (False, "cancelled")}  # fmt: skip
        for rid, (ok, reason) in stage0.items():
            outcomes = [HandoffOutcome(rid, 0, ok, reason, "", 0, 0.01),
                        HandoffOutcome(rid, 1, True, "", "", 0, 0.01)]  # fmt: skip
            if order == "token first":
                table.finish(rid, 0, 3, 0.5)
            for outcome in outcomes:
                table.handoff_settled(outcome)
            if order == "outcomes first":
                table.finish(rid, 0, 3, 0.5)
        assert records["stopped"].status is Status.HANDING_OFF  # the confirmation ends it
        assert records["too late"].status is Status.DONE
        assert records["peer"].status is Status.DONE
        assert records["peer"].result().handoff["status"] == "failed"
        table.settle_cancel("stopped")
        assert records["stopped"].status is Status.CANCELLED
        assert records["stopped"].error == "client went away"  # not cleared by the token

    run(main)


@pytest.mark.parametrize("tokens, reason, words", [
    (np.arange(0, dtype=np.int32), "invalid", "empty prompt"),
    (np.array([1, 100]), "invalid", "outside the vocabulary"),
    (np.array([1, -1]), "invalid", "outside the vocabulary"),
    ([1, True], "invalid", "must be integers"),
    ([1.5], "invalid", "must be integers"),
    (np.zeros((2, 2), dtype=np.int32), "invalid", "flat list"),
    (np.arange(41, dtype=np.int32) % 100, "too_long", "smallest stage pool"),
])  # fmt: skip
def test_a_prompt_is_checked_once_at_intake_with_its_reason(tokens, reason, words):
    def main() -> None:
        table, intake = book()
        with pytest.raises(RequestRejected, match=words) as error:
            intake.submit(spec("a", tokens))
        assert error.value.reason == reason
        assert not table.taken("a") and not table.waiting and table.num_unfinished == 0

    run(main)


def test_every_other_refusal_names_its_reason():
    def main() -> None:
        table, intake = book()
        intake.submit(spec("a"))
        cases = [(lambda: intake.submit(spec("a")), "duplicate"),
                 (lambda: intake.submit(spec("bad/id")), "invalid"),
                 (lambda: intake.submit(spec("b"), priority=1.5), "invalid")]  # fmt: skip
        for submit, reason in cases:
            with pytest.raises(RequestRejected) as error:
                submit()
            assert error.value.reason == reason
        table.drain()
        with pytest.raises(RequestRejected) as error:
            intake.submit(spec("c"))
        assert error.value.reason == "draining"

    run(main)


def test_a_list_prompt_is_queued_as_int32_ids():
    def main() -> None:
        _, intake = book()
        record = intake.submit(spec("a", [5, 6, 7]))
        assert record.spec.tokens.dtype == np.int32 and record.spec.tokens.tolist() == [5, 6, 7]

    run(main)


def test_a_server_forgets_ended_records_and_keeps_recent_ids():
    def main() -> None:
        table, intake = book(retain_ended=3)
        for i in range(10):
            rid = f"r{i}"
            intake.submit(spec(rid))
            table.waiting.remove(rid)
            table.ask_cancel(rid, "cancelled")
            table.settle_cancel(rid)
        sizes = table.sizes()
        assert sizes["records"] == 0 and sizes["ended_ids"] == 3 and sizes["kept_records"] == 0
        assert table.taken("r9") and not table.taken("r0")  # r0's id is free again
        assert table.totals["cancelled"] == 10  # the counters cover the forgotten ones
        assert len(table.take_ended()) == 10 and not table.take_ended()

    run(main)


def test_an_offline_run_keeps_every_record_in_submission_order():
    def main() -> None:
        table, intake = book()
        for rid in ("a", "b"):
            intake.submit(spec(rid))
        with pytest.raises(RequestRejected):
            intake.submit(spec("c", np.array([999])))
        table.waiting.remove("a")
        table.ask_cancel("a", "cancelled")
        table.settle_cancel("a")
        assert [r.spec.request_id for r in table.records()] == ["a", "b", "c"]
        assert [r.status for r in table.records()] == [Status.CANCELLED, Status.QUEUED,
                                                       Status.REJECTED]  # fmt: skip

    run(main)


def test_the_waiting_load_counts_the_queued_prompts_and_the_oldest_submission():
    def main() -> None:
        table, intake = book()
        assert table.waiting_load() == (0, None)
        first = intake.submit(spec("a"))
        intake.submit(spec("b", np.arange(5, dtype=np.int32)), priority=3)
        assert table.waiting_load() == (13, first.released_at)  # b is offered first
        table.waiting.pop_admitted(["b"])
        table.admitted("b", 1.0)
        assert table.waiting_load() == (8, first.released_at)
        table.waiting.remove("a")
        assert table.waiting_load() == (0, None)

    run(main)


def test_a_cancel_confirmed_while_bands_are_out_ends_with_the_last_outcome():
    """The stages confirm a cancel of a request handing off before their bands' outcomes
    come: it ends cancelled once every stage's band has ended, its result saying how."""
    from wavepp.rounds.messages import HandoffOutcome

    def main() -> None:
        table = RequestTable(lambda line: None, num_stages=2)
        intake = Intake(table, 4, 10, 100, handoff_target=lambda spec: "pull:")
        record = intake.submit(RequestSpec("a", np.arange(8, dtype=np.int32), False, 0,
                                           handoff=True))  # fmt: skip
        table.waiting.remove("a")
        table.admitted("a", 0.0)
        table.started("a", 0.0)
        table.finish("a", 0, 3, 0.5)
        assert record.answered.is_set() and not record.finished.is_set()  # a pull: answered
        assert record.answer().status == "done" and record.answer().handoff["status"] == "held"
        table.ask_cancel("a", "cancelled by DELETE")
        table.settle_cancel("a")
        assert record.status is Status.HANDING_OFF and record.cancel_confirmed
        table.handoff_settled(HandoffOutcome("a", 1, False, "cancelled", "", 0, 0.01))
        assert record.status is Status.HANDING_OFF
        table.handoff_settled(HandoffOutcome("a", 0, False, "cancelled", "", 0, 0.01))
        assert record.status is Status.CANCELLED and record.error == "cancelled by DELETE"
        stages = record.result().handoff["stages"]
        assert [(s["stage"], s["reason"]) for s in stages] == [(0, "cancelled"), (1, "cancelled")]

    run(main)


@pytest.mark.parametrize("logit", [float("nan"), float("inf"), float("-inf")])
def test_a_first_token_whose_logits_are_not_finite_fails_that_request_alone(logit):
    def main() -> None:
        table, intake = book()
        records = {rid: intake.submit(spec(rid)) for rid in ("bad", "good")}
        for rid in records:
            table.waiting.remove(rid)
            table.admitted(rid, 1.0)
            table.started(rid, 2.0)
        table.finish("bad", 0, 3, logit)
        table.finish("good", 0, 7, 1.5)
        bad, good = records["bad"].result(), records["good"].result()
        assert bad.status == "failed" and bad.first_token is None and bad.top_logit is None
        assert "logits at the prompt's last position are not finite" in bad.error
        assert good.status == "done" and good.first_token == 7
        assert table.totals["failed"] == 1 and table.num_unfinished == 0

    run(main)
