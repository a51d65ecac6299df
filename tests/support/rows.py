"""Helpers for tests that turn a Scheduler by hand: what each row delivered, and turning
until every row has left."""

from __future__ import annotations

from mtplxd.engine import GenerationResult, TokenDelta
from mtplxd.engine.scheduler import Scheduler

# Different lengths, kinds of text and ends (mid-word, mid-call): rows that run side by side.
PROMPTS = [
    "def add(a, b):\n    ret",
    "le café est tr",
    "x",
    "import json\nwith open(path) as f:\n    data = json.lo",
    "The quick brown fox jumps over the lazy dog, and then",
    "for i in range(10):\n    print(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push",
    "SELECT name FROM users WHERE",
]


class Collector:
    """What one row delivered, in order, plus a shared log of (row name, kind) events."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.items: list = []

    def __call__(self, item) -> None:
        self.items.append(item)
        kind = type(item).__name__
        self.log.append((self.name, kind))

    @property
    def result(self) -> GenerationResult:
        assert isinstance(self.items[-1], GenerationResult), self.items[-1]
        return self.items[-1]


def run_until_idle(scheduler: Scheduler, max_turns: int = 10_000) -> int:
    turns = 0
    while scheduler.has_work():
        scheduler.turn()
        turns += 1
        assert turns < max_turns
    return turns


def assert_each_row_equals(sinks: list[Collector], references: list[GenerationResult],
                           depths: list[int]) -> None:
    """Each row's result and its streamed tokens equal its reference (a solo run)."""
    for i, (sink, reference) in enumerate(zip(sinks, references)):
        result = sink.result
        assert result.token_ids == reference.token_ids, f"row {i} (depth {depths[i]}) diverged"
        assert result.text == reference.text and result.finish_reason == reference.finish_reason
        streamed = [t for item in sink.items if isinstance(item, TokenDelta) for t in item.token_ids]
        assert streamed == result.token_ids
