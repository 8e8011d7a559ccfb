"""One writer, many readers: readers only ever see whole batches, with matching vectors and texts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from memory import MemoryVectorDB

DIM, BATCH, BATCHES = 32, 50, 40


@pytest.mark.parametrize("index", ["flat", "hnsw"])
def test_readers_during_writes_see_consistent_snapshots(index):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * BATCHES, DIM)).astype(np.float32)  # id i is always x[i]
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    db = MemoryVectorDB(DIM, index)
    db.add(x[:BATCH], [f"t{i}" for i in range(BATCH)])
    done = threading.Event()
    errors: list[str] = []
    sizes: set[int] = set()
    reads = [0]

    def check_ids(ids: np.ndarray, where: str) -> None:
        batches = set((ids // BATCH).tolist())
        if len(ids) != len(batches) * BATCH or len(set(ids.tolist())) != len(ids):
            errors.append(f"{where}: ids are not whole batches: {sorted(ids.tolist())[:10]}... ({len(ids)})")

    def reader(seed: int) -> None:
        r = np.random.default_rng(seed)
        while not done.is_set() and len(errors) < 5:
            q = r.standard_normal(DIM).astype(np.float32)
            scores, ids = db.topk(q, None)
            sizes.add(len(ids))
            check_ids(ids.numpy(), "topk")
            want = unit[ids.numpy()] @ (q / np.linalg.norm(q))
            if not np.allclose(scores.numpy(), want, atol=1e-5):
                errors.append("topk: scores do not match the vectors of their ids")
            for hit in db.search(q, 8):
                i = hit["index"]
                if not np.array_equal(hit["embedding"].numpy(), x[i]) or hit.get("text", f"t{i}") != f"t{i}":
                    errors.append(f"search: entry {i} has another entry's vector or text")
            reads[0] += 1

    def writer() -> None:
        try:
            for b in range(1, BATCHES):
                ids = db.add(x[b * BATCH:(b + 1) * BATCH], [f"t{i}" for i in range(b * BATCH, (b + 1) * BATCH)])
                assert ids == list(range(b * BATCH, (b + 1) * BATCH))
                if b % 7 == 0:  # drop a whole earlier batch now and then
                    db.remove(range((b - 3) * BATCH, (b - 2) * BATCH))
                time.sleep(0.002)  # let the readers in between writes
        except Exception as e:  # pragma: no cover - reported below
            errors.append(f"writer: {e!r}")
        finally:
            done.set()

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert reads[0] > 20 and len(sizes) > 3, (reads[0], sizes)  # the readers really overlapped the writes
    removed = len([b for b in range(1, BATCHES) if b % 7 == 0])
    assert len(db) == (BATCHES - removed) * BATCH
    check_ids(db.topk(x[0], None)[1].numpy(), "final")
    assert errors == []


def test_rwlock_excludes_writer_from_readers():
    from memory.ann import RWLock

    lock, guard = RWLock(), threading.Lock()
    state = {"readers": 0, "writers": 0, "max_readers": 0}
    bad: list[str] = []
    go = threading.Barrier(5)

    def enter(kind: str) -> None:
        with guard:
            state[kind] += 1
            state["max_readers"] = max(state["max_readers"], state["readers"])
            if state["writers"] and (state["readers"] or state["writers"] > 1):
                bad.append(dict(state).__repr__())

    def leave(kind: str) -> None:
        with guard:
            state[kind] -= 1

    def run(kind: str) -> None:
        go.wait()
        for _ in range(300):
            with (lock.read() if kind == "readers" else lock.write()):
                enter(kind)
                time.sleep(0)
                leave(kind)

    threads = [threading.Thread(target=run, args=("readers",)) for _ in range(3)]
    threads += [threading.Thread(target=run, args=("writers",)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    assert state["max_readers"] > 1  # readers did share the lock
