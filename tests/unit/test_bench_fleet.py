"""The fleet bench's pieces (issue 33, item 5) and the load generator's rate and deadlines."""

from __future__ import annotations

import itertools

import anyio
import attrs
import numpy as np
import pytest

from benchmarks import fleet
from tests.helpers.fake_engine import FakeEngine
from wavepp.bench.load import amain, parser, validate, with_arrivals
from wavepp.serve.server import serve
from wavepp.state import block_hashes
from wavepp.workload import RequestSpec, conversation


def test_shifted_runs_keep_the_workload_and_share_no_block():
    specs = conversation(12, 256, 0, 16, 1000)
    a, b = fleet._shifted(specs, 1, 1000), fleet._shifted(specs, 2, 1000)
    assert [s.num_tokens for s in a] == [s.num_tokens for s in specs]
    assert [s.expected_reuse for s in a] == [s.expected_reuse for s in specs]
    hashes_a = {h for s in a for h in block_hashes(s.tokens, 16)}
    hashes_b = {h for s in b for h in block_hashes(s.tokens, 16)}
    assert not hashes_a & hashes_b
    # the same prefixes are shared inside a run as in the workload
    assert fleet.working_set_blocks(a, 16) == fleet.working_set_blocks(specs, 16)
    assert all(0 <= t < 1000 for s in a for t in s.tokens)


def test_with_arrivals_sets_poisson_arrivals_and_deadlines_on_measured_requests():
    specs = [RequestSpec("w", np.arange(4, dtype=np.int32), True, 0)]
    specs += [RequestSpec(f"m{i}", np.arange(4, dtype=np.int32), False, 0,
                          deadline_s=9.0 if i == 0 else None) for i in range(200)]  # fmt: skip
    args = parser().parse_args(["--url", "http://x", "--workload", "cold", "--concurrency",
                                "1", "--rate", "50", "--deadline-s", "0.5"])  # fmt: skip
    validate(args)
    out = with_arrivals(specs, args)
    assert out[0].arrival_s is None and out[0].deadline_s is None  # warm-up untouched
    arrivals = [s.arrival_s for s in out[1:]]
    assert all(b > a for a, b in itertools.pairwise(arrivals))
    assert 200 / arrivals[-1] == pytest.approx(50, rel=0.25)
    assert out[1].deadline_s == 9.0 and {s.deadline_s for s in out[2:]} == {0.5}
    with pytest.raises(SystemExit, match="--rate"):
        validate(parser().parse_args(["--url", "http://x", "--trace", "t.jsonl",
                                      "--concurrency", "1", "--rate", "5"]))  # fmt: skip


@pytest.mark.anyio
async def test_load_reports_slo_attainment_from_client_and_server():
    engine = FakeEngine(vocab_size=1000, tokens_per_s=2000)
    ready, where = anyio.Event(), {}

    def on_ready(host: str, port: int) -> None:
        where["url"] = f"http://{host}:{port}"
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        tg.start_soon(lambda: serve(engine, "127.0.0.1", 0, on_ready=on_ready))
        with anyio.fail_after(30):  # hang guards
            await ready.wait()
        args = parser().parse_args(["--url", where["url"], "--no-progress", "--workload",
                                    "cold", "--requests", "12", "--prompt-tokens", "64",
                                    "--concurrency", "4", "--rate", "200",
                                    "--deadline-s", "1000"])  # fmt: skip
        with anyio.fail_after(120):
            record = await amain(args)
        engine.drain()
    assert record["open_loop"] and record["rate"] == 200
    assert record["slo_attainment"] == 1.0 and record["server_slo_attainment"] == 1.0
    assert all(r["deadline_met"] is True and r["deadline_s"] == 1000
               for r in record["requests"])  # fmt: skip


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_table_and_plots_say_simulated(tmp_path):
    setup = fleet.setup_from(fleet.parser().parse_args(["--quick"]))
    assert setup.replicas == (2,) and setup.loads == (0.5, 1.5, 3.0)
    rows = [{"replicas": 2, "policy": policy, "workload": "trace", "load": load,
             "offered_tok_s": load * 180_000, "throughput_tok_s": 1e5, "good_hit_rate": None,
             "reused_share": 0.1, "completion_p50_s": 0.5, "completion_p99_s": 1.0,
             "slo_attainment": 1.0 / load, "slo_s": 2.0}
            for policy in ("round-robin", "prefix", "ceiling") for load in (1.0, 2.0)]  # fmt: skip
    record = {"setup": attrs.asdict(setup), "kv_events": False, "rows": rows}
    text = fleet.table(record)
    assert text.startswith("WavePP fleet — SIMULATED") and "KV events OFF" in text
    assert text.count("\ntrace") == 6
    (path,) = fleet.plot(record, tmp_path)
    assert path.name == "fleet_slo_trace_n2.png" and path.stat().st_size > 1000


def test_closed_loop_runs_replace_the_loads_and_say_saturated(tmp_path):
    setup = fleet.setup_from(fleet.parser().parse_args(["--closed-loop", "16"]))
    assert setup.closed_loop == 16 and fleet._loads(setup) == (None,)
    argv = fleet._load_argv("conversation", setup, "http://x", None, None, concurrency=32)
    args = parser().parse_args(argv)
    validate(args)
    assert args.concurrency == 32 and args.rate is None  # closed loop, N x C in flight
    row = {"replicas": 2, "policy": "prefix", "workload": "conversation", "load": None,
           "closed_loop": 16, "offered_tok_s": None, "throughput_tok_s": 7e5,
           "good_hit_rate": 0.9, "reused_share": 0.6, "completion_p50_s": 0.4,
           "completion_p99_s": 1.0, "slo_attainment": 0.5, "slo_s": 1.0}  # fmt: skip
    assert "closed loop, 16 in flight a replica" in fleet._line(row)
    record = {"setup": attrs.asdict(setup), "kv_events": True, "rows": [row]}
    assert "closed    (saturated)" in fleet.table(record)
    assert fleet.plot(record, tmp_path) == []  # no offered load to plot against
    with pytest.raises(SystemExit, match="--closed-loop"):
        fleet.main(["--closed-loop", "0"])


def test_the_bench_finds_the_repository_and_its_trace():
    """Its paths are the repository's (the module sits in the top-level benchmarks/)."""
    assert (fleet.ROOT / "pyproject.toml").is_file()
    assert fleet.TRACE.is_file()


def test_chosen_ports_are_free_distinct_and_below_the_ephemeral_range():
    """A port the kernel picks for a connection while a replica starts never collides
    with one chosen for it."""
    import socket
    from pathlib import Path

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = fleet._free_ports(12)
    assert len(set(ports)) == 12 and all(10000 <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
