"""The Redis stream's overhead per record: pushing, and reading through the trainer's consumer group
(decode, validate, pack, acknowledge, trim), against reading and validating the same records from a
JSON Lines file. Rounds alternate the two paths within one process.

    python -m benchmarks.stream_queue [--records 2000] [--completion 64] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.output import report
from rlcli.data.readers import load_rollouts
from rlcli.stream import EmbeddedRedis, StreamWriter, connect
from rlcli.stream.reader import ReaderOptions, StreamReader

VOCAB = 1000


def make_records(n: int, prompt: int, completion: int) -> list[dict]:
    return [{"prompt_ids": [(i + j) % VOCAB for j in range(prompt)],
             "completion_ids": [(3 * i + j) % VOCAB for j in range(completion)],
             "old_logprobs": [-1.5] * completion, "advantage": float(i % 2), "reward": float(i % 2),
             "group_id": i // 8, "temperature": 1.0, "id": f"r{i}", "policy_version": 0} for i in range(n)]


def time_stream(url: str, records: list[dict], max_tokens: int, run_dir: Path, round_: int) -> tuple[float, float]:
    """Seconds to push ``records`` and to read them all back as micro-batches (acknowledged at the end)."""
    stream = f"bench:{round_}"
    started = time.perf_counter()
    with StreamWriter(url, stream) as writer:
        for first in range(0, len(records), 500):
            writer.push_many(records[first:first + 500])
    pushed = time.perf_counter()
    options = ReaderOptions(stream=stream, group="bench", max_tokens=max_tokens, vocab_size=VOCAB, max_lag=0,
                            temperature=1.0, allow_temperature_mismatch=False, need_ref_logprobs=False,
                            wait_warning=60, idle_timeout=None)
    reader = StreamReader(connect(url), options, "rank0", run_dir / "rejected.jsonl")
    read = 0
    started_reading = time.perf_counter()
    while read < len(records):
        batch = reader.next_micro_batch()
        reader.resolve(batch.documents)
        read += batch.num_documents
    reader.acknowledge(reader.resolved)
    return pushed - started, time.perf_counter() - started_reading


def time_file(path: Path, max_tokens: int) -> float:
    from rlcli.data.document_stream import pack_documents

    started = time.perf_counter()
    rollouts, _ = load_rollouts([path], vocab_size=VOCAB, max_tokens=max_tokens, on_invalid="error")
    for _ in pack_documents(rollouts, max_tokens):
        pass
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_queue", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per record")
    parser.add_argument("--completion", type=int, default=64, help="completion tokens per record")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    records = make_records(args.records, args.prompt, args.completion)
    max_tokens = 4 * (args.prompt + args.completion)
    push_s, read_s, file_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / "records.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        with EmbeddedRedis(tmp / "redis") as server:
            for round_ in range(args.rounds):  # the two paths in turns
                push, read = time_stream(server.url, records, max_tokens, tmp, round_)
                push_s.append(push)
                read_s.append(read)
                file_s.append(time_file(path, max_tokens))
    per = lambda seconds: statistics.median(seconds) / args.records * 1e6  # noqa: E731  µs per record
    result = {
        "records": args.records, "tokens_per_record": args.prompt + args.completion,
        "record_bytes": len(json.dumps(records[0])),
        "push_us_per_record": per(push_s), "stream_read_us_per_record": per(read_s),
        "file_read_us_per_record": per(file_s),
        "overhead_us_per_record": per(push_s) + per(read_s) - per(file_s),
    }
    table = "\n".join([
        f"stream queue: {args.records} records of {result['tokens_per_record']} tokens "
        f"({result['record_bytes']} bytes of JSON), median of {args.rounds} rounds",
        f"  push (XADD, 500 per round trip)          {result['push_us_per_record']:8.1f} µs/record",
        f"  read via consumer group + validate + ack {result['stream_read_us_per_record']:8.1f} µs/record",
        f"  read + validate from a JSONL file        {result['file_read_us_per_record']:8.1f} µs/record",
        f"  overhead of the stream                   {result['overhead_us_per_record']:8.1f} µs/record",
    ])
    return report(result, table, args.json)


if __name__ == "__main__":
    main()
