"""The chat worker's rounds (`chat.worker.Worker`) over answers that park their turns in a `decoding.batch.Batch`,
for the graph tests (`test_graph.py` runs on a GPU machine with `--noconftest`: this module needs nothing of the
tests' fixtures)."""

from __future__ import annotations

from decoding.batch import Batch, Parked


def drive(batch: Batch, starts: list[tuple[int, object]], failed: dict | None = None) -> list[list]:
    """The chat worker's rounds (`chat.worker.Worker`): each running answer is advanced to its next parked turn (one
    that never parked yet: by one event), then the batch runs the turns; `starts`: (the round it starts in, a
    callable making its event stream). Every answer's events. A round that raises fails the answers parked in it
    (closed, their error in `failed`), as `Worker._run_batch` does; an answer that raises (a turn its runner failed:
    `Batch.park`) fails alone, as in `Worker._step`."""
    events: list[list] = [[] for _ in starts]
    running: dict[int, object] = {}
    stepping: set[int] = set()  # answers that decode in the batch: advanced to their next turn (others: one event)
    rnd = 0
    while rnd <= max(s for s, _ in starts) or running:
        for i, (at, make) in enumerate(starts):
            if at == rnd:
                running[i] = make()
        parked = []
        for i in list(running):
            while True:
                try:
                    event = next(running[i])
                except StopIteration:
                    del running[i]
                    break
                except Exception as e:  # noqa: BLE001
                    del running[i]
                    failed[i] = str(e)
                    break
                if isinstance(event, Parked):
                    stepping.add(i)
                    parked.append(i)
                    break
                events[i].append(event)
                if i not in stepping:
                    break
        try:
            batch.run()
        except RuntimeError as e:
            for i in parked:
                running.pop(i).close()
                failed[i] = str(e)
            batch.clear()
        rnd += 1
    return events
