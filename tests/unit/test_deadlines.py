"""Deadlines end to end on rank 0's side: the intake's order and verdicts, the HTTP bodies,
requests files, trace lines, the run's record and ``/metrics`` (issue 33, item 3)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import anyio
import httpx
import numpy as np
import pytest

from tests.helpers.fake_engine import FakeEngine
from wavepp.metrics import summarize
from wavepp.policy import EDF, POLICIES, Policy, load_policy
from wavepp.runtime.intake import Intake
from wavepp.runtime.records import RequestRejected
from wavepp.runtime.table import RequestTable
from wavepp.serve.api import ApiError, parse_completion, parse_prefill, result_body
from wavepp.serve.app import build_app
from wavepp.serve.prom import ServerMetrics, parse_exposition, sample
from wavepp.workload import RequestSpec, read_requests_file, trace

CONFIG = {"rung": "R4", "workload": "test", "concurrency": 1}


def spec(rid: str, deadline_s: float | None = None, warmup: bool = False) -> RequestSpec:
    return RequestSpec(rid, np.arange(8, dtype=np.int32), warmup, 0, deadline_s=deadline_s)


class Book:
    """The intake and the request table it queues into (rank 0's side, no runtime)."""

    def __init__(self, order: str) -> None:
        self.table = RequestTable(lambda line: None, queue_order=order)
        self.intake = Intake(self.table, 4, 1000, None)
        self.records = {}  # every submitted record, by id

    def submit(self, spec: RequestSpec) -> None:
        self.records[spec.request_id] = self.intake.submit(spec)

    def run_to_end(self, rid: str) -> None:
        """Admit it, start it, and let its first token come back."""
        self.table.waiting.remove(rid)
        self.table.admitted(rid, self.records[rid].released_at)
        self.table.started(rid, self.records[rid].released_at)
        self.table.finish(rid, 0, 7, 1.0)


def intake(order: str) -> Book:
    return Book(order)


def run(fn) -> None:
    async def main() -> None:
        with anyio.fail_after(30):  # a hang guard
            await fn()

    anyio.run(main)


# -- the policy field ----------------------------------------------------------------------


def test_queue_order_is_a_policy_field_with_fcfs_by_default():
    assert Policy().queue_order == "fcfs"
    assert EDF.queue_order == "edf" and load_policy("edf") is EDF and POLICIES["edf"] is EDF
    assert EDF.describe()["queue_order"] == "edf"
    with pytest.raises(ValueError, match="queue_order"):
        Policy(queue_order="lifo")


# -- the intake ------------------------------------------------------------------------------


@pytest.mark.parametrize("order, expected", [("edf", ["c", "b", "a", "d"]),
                                             ("fcfs", ["a", "b", "c", "d"])])  # fmt: skip
def test_intake_queues_by_the_policy_order(order, expected):
    async def main() -> None:
        book = intake(order)
        for rid, due in [("a", None), ("b", 50.0), ("c", 10.0), ("d", None)]:
            book.submit(spec(rid, due))
        assert book.table.waiting.head() == expected

    run(main)


def test_results_say_whether_the_deadline_was_met():
    async def main() -> None:
        book = intake("edf")
        for rid, due in [("in-time", 60.0), ("late", 1.0), ("none", None), ("gone", 5.0),
                         ("broke", 5.0)]:  # fmt: skip
            book.submit(spec(rid, due))
        book.records["late"].released_at -= 10.0  # submitted 10 s ago: its 1 s has passed
        for rid in ("in-time", "late", "none"):
            book.run_to_end(rid)
        book.table.waiting.remove("gone")
        book.table.ask_cancel("gone", "cancelled")
        book.table.settle_cancel("gone")
        book.table.waiting.remove("broke")
        book.table.fail("broke", "rank 1 died")
        results = {rid: book.records[rid].result() for rid in book.records}
        assert {rid: r.deadline_met for rid, r in results.items()} == {
            "in-time": True, "late": False, "none": None, "gone": False, "broke": False}
        assert results["in-time"].deadline_s == 60.0 and results["none"].deadline_s is None
        assert (book.table.with_deadline, book.table.deadlines_met) == (4, 1)
        assert book.table.num_unfinished == 0 and not book.table.get("late")
        assert results["late"].to_json()["deadline_met"] is False

    run(main)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, 2e6, True, "5"])
def test_a_bad_deadline_is_rejected_and_leaves_no_trace(bad):
    async def main() -> None:
        book = intake("edf")
        with pytest.raises(RequestRejected, match="deadline_s must be a number of seconds"):
            book.submit(spec("a", bad))
        assert not book.table.taken("a") and not book.table.waiting
        assert book.table.num_unfinished == 0
        book.submit(spec("a", 1))  # the id is still free; an int is a number of seconds

    run(main)


# -- HTTP bodies -----------------------------------------------------------------------------


def test_bodies_carry_the_deadline():
    sub = parse_prefill(b'{"tokens": [1, 2], "deadline_s": 2.5}', None)
    assert sub.deadline_s == 2.5
    assert parse_prefill(b'{"tokens": [1, 2], "deadline_s": 3}', None).deadline_s == 3
    assert parse_prefill(b'{"tokens": [1, 2]}', None).deadline_s is None
    sub, _ = parse_completion(b'{"prompt": [1, 2], "deadline_s": 0.5}', None)
    assert sub.deadline_s == 0.5
    for bad in (b"0", b"-1", b'"soon"', b"1e7", b"true"):
        with pytest.raises(ApiError, match="deadline_s") as error:
            parse_prefill(b'{"tokens": [1], "deadline_s": ' + bad + b"}", None)
        assert error.value.status == 400


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_http_answers_deadline_met_and_orders_a_class_by_deadline():
    # one 30-token prompt at a time fits: requests are done in admission order
    engine = FakeEngine(vocab_size=100, capacity_tokens=40, queue_order="edf")
    transport = httpx.ASGITransport(app=build_app(engine))
    done_order: list[str] = []
    bodies: dict[str, dict] = {}

    async def post(rid: str, due: float | None, priority: int = 0) -> None:
        body = {"tokens": list(range(1, 31)), "id": rid, "priority": priority}
        if due is not None:
            body["deadline_s"] = due
        reply = await client.post("/v1/prefill", json=body)
        assert reply.status_code == 200, reply.text
        bodies[rid] = reply.json()
        done_order.append(rid)

    async with httpx.AsyncClient(transport=transport, base_url="http://w") as client, \
            anyio.create_task_group() as tg:  # fmt: skip
        with anyio.fail_after(30):  # a hang guard
            tg.start_soon(engine.run)
            engine.pause()
            for rid, due, priority in [("plain", None, 0), ("late", 100.0, 0), ("soon", 20.0, 0),
                                       ("high", None, 1)]:  # fmt: skip
                tg.start_soon(post, rid, due, priority)
                while rid not in engine.requests:
                    await anyio.sleep(0.001)
            engine.resume()
            while len(done_order) < 4:
                await anyio.sleep(0.005)
            engine.drain()
    assert done_order == ["high", "soon", "late", "plain"]
    assert bodies["soon"]["deadline_met"] is True and bodies["soon"]["deadline_s"] == 20.0
    assert "deadline_met" not in bodies["plain"]


def test_result_body_without_a_deadline_is_unchanged():
    from wavepp.engine import Result

    plain = Result("r", "done", 1, 1.0, 4, 0, None, 1.0, 1.1, 1.2, 1.3)
    assert "deadline_met" not in result_body(plain, False)
    timed = Result("r", "done", 1, 1.0, 4, 0, None, 1.0, 1.1, 1.2, 1.3, deadline_s=0.1,
                   deadline_met=False)
    assert result_body(timed, False)["deadline_met"] is False


# -- requests files and traces ---------------------------------------------------------------


def test_requests_file_lines_carry_deadlines(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [{"id": "a", "tokens": [1, 2], "deadline_s": 1.5}, {"id": "b", "tokens": [3]},
             {"id": "c", "tokens": [4], "deadline_s": 0}, {"id": "d", "tokens": [5],
             "deadline_s": "1"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    specs, rejected, _ = read_requests_file(path, 10)
    assert [(s.request_id, s.deadline_s) for s in specs] == [("a", 1.5), ("b", None)]
    assert [(r["line"], r["id"]) for r in rejected] == [(3, "c"), (4, "d")]
    assert all("'deadline_s' must be seconds" in r["error"] for r in rejected)


def test_trace_deadlines_scale_like_timestamps(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 10, "hash_ids": [1]},
            {"timestamp": 100, "input_length": 10, "hash_ids": [2], "deadline_ms": 500},
            {"timestamp": 200, "input_length": 10, "hash_ids": [3], "deadline_ms": -1}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = trace(path, None, 0, 4, open_loop=True, time_scale=2.0, deadline_s=3.0)
    assert [s.deadline_s for s in specs] == [6.0, 1.0]  # the bad third line is skipped
    assert [s.deadline_s for s in trace(path, None, 0, 4)] == [None, 0.5]


# -- the record and /metrics -----------------------------------------------------------------


def test_record_reports_slo_attainment():
    async def main() -> None:
        book = intake("edf")
        for rid, due, warm in [("w", 1.0, True), ("a", 60.0, False), ("b", 1.0, False),
                               ("c", None, False), ("d", 60.0, False)]:  # fmt: skip
            book.submit(spec(rid, due, warm))
        book.records["b"].released_at -= 10.0
        for rid in ("w", "a", "b", "c"):
            book.run_to_end(rid)
        # "d" never ended (an interrupted run): missed
        record = summarize(list(book.records.values()), [], measure_start=0.0, measure_end=1.0,
                           round_seconds=[], time_scale=1.0, simulated=True, config=CONFIG)
        assert (record["deadline_requests"], record["deadlines_met"]) == (3, 1)
        assert record["slo_attainment"] == pytest.approx(1 / 3)
        rows = {r["id"]: r for r in record["requests"]}
        assert rows["a"]["deadline_met"] is True and rows["b"]["deadline_met"] is False
        assert "deadline_met" not in rows["c"]
        untimed = summarize([book.records["c"]], [], measure_start=0.0, measure_end=1.0,
                            round_seconds=[], time_scale=1.0, simulated=True, config=CONFIG)
        assert untimed["slo_attainment"] is None and untimed["deadline_requests"] == 0

    run(main)


def test_metrics_report_slo_attainment():
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(stats: dict) -> str:
        engine = SimpleNamespace(stats=lambda: stats, health=lambda: (True, "ok"))
        return ServerMetrics(engine, lambda: 0, dict).exposition().decode()

    text = scrape({"with_deadline": 8, "deadlines_met": 6, "requests": {"done": 8}})
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds["wavepp_engine_with_deadline"] == "counter"  # wavepp_..._total
    assert kinds["wavepp_engine_deadlines_met"] == "counter"
    s = parse_exposition(text)
    assert sample(s, "wavepp_engine_slo_attainment") == 0.75
    assert sample(s, "wavepp_engine_deadlines_met_total") == 6
    none = parse_exposition(scrape({"with_deadline": 0}))
    assert sample(none, "wavepp_engine_slo_attainment") is None
