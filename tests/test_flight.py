"""The flight recorder's file handling: rotation keeps every file together under the cap, the
reader returns records oldest first and skips torn lines, a full queue drops instead of
waiting, and the prompt-prefix hashes agree exactly as far as two prompts do."""

from __future__ import annotations

import json
import threading

from mtplxd.api.receipts import PREFIX_BLOCK, prefix_hashes
from mtplxd.flight import FlightRecorder, flight_files, read_records


def test_rotation_keeps_all_files_under_the_cap_and_the_newest_records(tmp_path):
    recorder = FlightRecorder(tmp_path, max_bytes=40_000, queue_records=4096)
    recorder.start()
    for i in range(2000):
        recorder.record({"id": i, "pad": "x" * 100})
    recorder.stop()
    files = flight_files(tmp_path)
    assert [f.name for f in files] == ["flight.3.jsonl", "flight.2.jsonl", "flight.1.jsonl", "flight.jsonl"]
    assert sum(f.stat().st_size for f in files) <= 40_000
    ids = [r["id"] for r in read_records(tmp_path)]
    assert ids == sorted(ids) and ids[-1] == 1999  # oldest first, the newest kept
    assert recorder.written == 2000 and recorder.dropped == 0
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files)


def test_a_torn_line_is_skipped(tmp_path):
    (tmp_path / "flight.jsonl").write_text(json.dumps({"id": 1}) + "\n{\"id\": 2, \"trunc\n"
                                           + json.dumps({"id": 3}) + "\n")
    assert [r["id"] for r in read_records(tmp_path)] == [1, 3]


def test_a_full_queue_drops_records_and_never_waits(tmp_path):
    recorder = FlightRecorder(tmp_path, max_bytes=1_000_000, queue_records=2)
    gate = threading.Event()
    original = recorder._write

    def slow_write(line: str) -> None:  # a disk that does not answer
        gate.wait(10)
        original(line)

    recorder._write = slow_write  # type: ignore[method-assign]
    recorder.start()
    for i in range(50):
        recorder.record({"id": i})  # returns at once even though nothing is written
    assert recorder.dropped >= 47
    gate.set()
    recorder.stop()
    assert recorder.written + recorder.dropped == 50


def test_switched_off_it_starts_no_thread_and_writes_nothing(tmp_path):
    recorder = FlightRecorder(tmp_path, max_bytes=1_000_000, enabled=False)
    recorder.start()
    recorder.record({"id": 1})
    recorder.stop()
    assert flight_files(tmp_path) == [] and recorder.written == 0


def test_prefix_hashes_agree_exactly_as_far_as_the_prompts_do():
    a = list(range(3 * PREFIX_BLOCK + 10))
    b = a[:2 * PREFIX_BLOCK] + [7] + a[2 * PREFIX_BLOCK + 1:]
    ha, hb = prefix_hashes(a), prefix_hashes(b)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert prefix_hashes(a[:PREFIX_BLOCK - 1]) == []


def test_chart_ticks_cover_the_data():
    from mtplxctl.trace.charts import nice_ticks

    for high in (0.3, 1.0, 1.8, 2512, 99_999):
        ticks = nice_ticks(0, high)
        assert ticks[0] == 0 and ticks[-1] >= high and len(ticks) <= 7
