"""Dynamic data sharding: the master's TODO / DOING / DONE queues.

The dataset's ``samples`` indexes are cut into shards of ``shard_size`` for
each epoch; a worker asks for the next shard and reports it done. A shard is
DONE once: a report from a worker that no longer holds the shard (it was
declared dead and the shard handed to another) is refused. A dead or leaving
worker's DOING shards go back to the front of TODO.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Samples ``[start, end)`` of ``epoch``; ``id`` is unique across epochs."""

    id: int
    epoch: int
    start: int
    end: int


class ShardQueue:
    """TODO / DOING / DONE over ``epochs`` passes of ``samples`` samples. Not
    thread-safe (the master calls it under its lock)."""

    def __init__(self, samples: int, shard_size: int, epochs: int = 1) -> None:
        if samples <= 0 or shard_size <= 0 or epochs <= 0:
            raise ValueError("samples, shard_size and epochs must be positive")
        per = -(-samples // shard_size)
        self.todo: deque[Shard] = deque(
            Shard(e * per + i, e, i * shard_size, min(samples, (i + 1) * shard_size))
            for e in range(epochs) for i in range(per))
        self.total = len(self.todo)
        self.doing: dict[int, tuple[Shard, str]] = {}
        self.done: dict[int, str] = {}

    def next(self, worker: str) -> Shard | None:
        """The next TODO shard, now DOING by ``worker``; None when TODO is empty."""
        if not self.todo:
            return None
        shard = self.todo.popleft()
        self.doing[shard.id] = (shard, worker)
        return shard

    def complete(self, worker: str, shard_id: int) -> bool:
        """DOING -> DONE if ``worker`` holds the shard; False (nothing changes) otherwise."""
        held = self.doing.get(shard_id)
        if held is None or held[1] != worker:
            return False
        del self.doing[shard_id]
        self.done[shard_id] = worker
        return True

    def release(self, worker: str) -> list[int]:
        """Every DOING shard of ``worker`` back to TODO (front); their ids."""
        back = [s for s, w in self.doing.values() if w == worker]
        for s in sorted(back, key=lambda s: s.id, reverse=True):
            del self.doing[s.id]
            self.todo.appendleft(s)
        return [s.id for s in back]

    @property
    def finished(self) -> bool:
        return len(self.done) == self.total

    def counts(self) -> dict[str, int]:
        return {"todo": len(self.todo), "doing": len(self.doing), "done": len(self.done)}
