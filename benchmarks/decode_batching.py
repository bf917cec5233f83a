"""``python -m benchmarks.decode_batching [--repeats 5] [--threads 1] [--json PATH]``:
the reference decode worker's continuous batching against one generation at a time.

Eight completions of mixed prompt and output lengths (``SHAPES``) arrive at once at the
worker's scheduler (``wavepp.decode.__main__.Scheduler``, in this process, on a tiny
random ``transformers`` Llama on CPU), each from its handed-off cache (built beforehand,
not timed): once batched (``--max-batch 8``: one forward per step for all of them, each
leaving when its tokens are done) and once one at a time (``--max-batch 1``, the worker's
behaviour before batching). The figure is decode tokens per second — every token after
the handed-off first, over the wall time from the eight submitted to the last one done —
and its ratio, batched over one at a time: ``--repeats`` pairs run alternately, the
ratio of the means with its 95% paired-bootstrap interval
(``benchmarks._stats.ratio_of_means_interval``). End-of-sequence is switched off so
every completion decodes exactly its ``max_tokens``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import torch

from benchmarks._stats import emit, ratio_of_means_interval
from wavepp.decode.__main__ import Scheduler
from wavepp.handoff.assembly import Handoff
from wavepp.handoff.hf import from_transformers_cache
from wavepp.handoff.wire import fingerprint_from_hf_config

SHAPES = [(24, 16), (200, 96), (64, 32), (120, 128), (16, 8), (300, 48), (90, 64), (40, 24)]
VOCAB = 512


def tiny_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every completion decodes its max_tokens
    return model


def handoffs(model) -> list[tuple[Handoff, int]]:
    """(the handed-off cache, max_tokens) of each completion."""
    fingerprint = fingerprint_from_hf_config(model.config.to_dict(), "float32")
    out = []
    for i, (length, max_tokens) in enumerate(SHAPES):
        tokens = torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(i))
        with torch.inference_mode():
            result = model(tokens[None], use_cache=True)
        cache = getattr(result, "cache", None) or result.past_key_values
        logits = result.logits[0, -1]
        layers = from_transformers_cache(cache, model)
        out.append((Handoff(f"c{i}", tokens, int(logits.argmax()), float(logits.max()), layers,
                            fingerprint, 1), max_tokens))  # fmt: skip
    return out


def run_once(model, work: list[tuple[Handoff, int]], max_batch: int) -> dict:
    """The eight at once through a fresh scheduler: decode tokens, seconds, tokens/s."""

    async def main() -> dict:
        scheduler = Scheduler(model, max_batch)
        produced = [0] * len(work)
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            start = time.perf_counter()
            async with anyio.create_task_group() as clients:
                for i, (handoff, max_tokens) in enumerate(work):

                    async def client(i=i, handoff=handoff, max_tokens=max_tokens) -> None:
                        def push(tokens: list[int]) -> None:
                            produced[i] += len(tokens)

                        generation = await scheduler.generate(handoff, max_tokens, push)
                        assert not generation.error, generation.error

                    clients.start_soon(client)
            seconds = time.perf_counter() - start
            tg.cancel_scope.cancel()
        expected = [m - 1 for _, m in work]
        assert produced == expected, (produced, expected)
        return {"tokens": sum(produced), "seconds": seconds,
                "tokens_per_s": sum(produced) / seconds, "steps": scheduler.batch.steps,
                "largest_batch": scheduler.batch.largest}  # fmt: skip

    return anyio.run(main)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_batching",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="pairs run (default 5, ≥ 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", default=None, help="also write the record here")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2")
    torch.set_num_threads(args.threads)
    model = tiny_model()
    work = handoffs(model)
    run_once(model, work, 8)  # warm-up, not counted
    runs: dict[str, list[dict]] = {"batched": [], "one_at_a_time": []}
    for repeat in range(args.repeats):
        order = (("batched", 8), ("one_at_a_time", 1))
        for name, max_batch in order if repeat % 2 == 0 else order[::-1]:
            runs[name].append(run_once(model, work, max_batch))
    on = [r["tokens_per_s"] for r in runs["batched"]]
    off = [r["tokens_per_s"] for r in runs["one_at_a_time"]]
    low, high = ratio_of_means_interval(on, off)
    record = {
        "benchmark": "decode_batching",
        "shapes": SHAPES,
        "threads": args.threads,
        "repeats": args.repeats,
        "batched_tokens_per_s": on,
        "one_at_a_time_tokens_per_s": off,
        "batched_mean": statistics.fmean(on),
        "one_at_a_time_mean": statistics.fmean(off),
        "ratio_of_means": statistics.fmean(on) / statistics.fmean(off),
        "ratio_interval_95": [low, high],
        "steps": {name: rs[0]["steps"] for name, rs in runs.items()},
        "largest_batch": {name: rs[0]["largest_batch"] for name, rs in runs.items()},
    }
    print(f"8 completions, {sum(m - 1 for _, m in SHAPES)} decode tokens, "
          f"{args.threads} thread(s), {args.repeats} pairs")  # fmt: skip
    print(f"  batched (max 8):      {record['batched_mean']:8.1f} tokens/s "
          f"({record['steps']['batched']} steps)")  # fmt: skip
    print(f"  one at a time:        {record['one_at_a_time_mean']:8.1f} tokens/s "
          f"({record['steps']['one_at_a_time']} steps)")  # fmt: skip
    print(f"  ratio of means:       {record['ratio_of_means']:.2f}x "
          f"(95% interval {low:.2f}–{high:.2f})")  # fmt: skip
    emit(record, args.json)
    return record


if __name__ == "__main__":
    main()
