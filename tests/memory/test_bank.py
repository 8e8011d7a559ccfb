"""MemoryVectorDB in memory: scores against a numpy reference, exact top-k, ids, validation."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from memory import BankError, MemoryVectorDB


def clustered(n: int, dim: int, seed: int = 0, clusters: int = 20) -> np.ndarray:
    """Raw (not normalised) vectors with cluster structure and varied norms."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, dim))
    x = centers[rng.integers(0, clusters, n)] + 0.6 * rng.standard_normal((n, dim))
    return (x * rng.uniform(0.5, 20, (n, 1))).astype(np.float32)


def cosine_ref(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    return (x64 @ q64) / (np.linalg.norm(x64, axis=1) * np.linalg.norm(q64))


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return clustered(2000, 48)


def test_search_matches_numpy_cosine_and_returns_raw_vectors(data):
    db = MemoryVectorDB(48)
    db.add(data)
    q = data[7] + 0.3
    ref = cosine_ref(data, q)
    hits = db.search(torch.tensor(q), top_k=10)
    assert [h["index"] for h in hits] == np.argsort(-ref)[:10].tolist()
    np.testing.assert_allclose([h["score"] for h in hits], np.sort(ref)[::-1][:10], atol=1e-5)
    top = hits[0]
    assert top["embedding"].dtype == torch.float32 and top["embedding"].shape == (48,)
    np.testing.assert_array_equal(top["embedding"].numpy(), data[top["index"]])  # raw, not normalised
    assert "text" not in top and "metadata" not in top


def test_query_forms_agree(data):
    db = MemoryVectorDB(48)
    db.add(data)
    q = data[3] * 2 + 1
    want = db.topk(q, 5)
    for form in (torch.tensor(q)[None], torch.tensor(q, dtype=torch.float64), q[None], list(q)):
        s, i = db.topk(form, 5)
        assert i.tolist() == want[1].tolist()
    assert db.topk(torch.tensor(q, dtype=torch.bfloat16), 1)[1].tolist() == want[1][:1].tolist()
    with pytest.raises(ValueError, match=r"expected shape \[48\] or \[1, 48\], got \(2, 48\)"):
        db.topk(np.stack([q, q]), 5)
    with pytest.raises(ValueError, match="non-zero"):
        db.search(np.zeros(48), 3)


@pytest.mark.parametrize("index", ["flat", "hnsw", "ivf"])
def test_topk_is_exact_for_flat_and_for_the_whole_bank(data, index):
    db = MemoryVectorDB(48, index, ivf_nlist=16, ivf_nprobe=1, hnsw_ef_search=16)
    db.add(data)
    rng = np.random.default_rng(1)
    for q in rng.standard_normal((5, 48)).astype(np.float32):
        ref = cosine_ref(data, q)
        scores, ids = db.topk(torch.tensor(q), 25)
        assert scores.dtype == torch.float32 and ids.dtype == torch.int64 and len(ids) == 25
        assert torch.all(scores[:-1] >= scores[1:])
        np.testing.assert_allclose(scores.numpy(), ref[ids.numpy()], atol=1e-5)  # true cosines of what it found
        if index == "flat":
            assert ids.tolist() == np.argsort(-ref)[:25].tolist()
        all_scores, all_ids = db.topk(q, None)  # the whole bank: exact, whatever the index
        assert sorted(all_ids.tolist()) == list(range(len(data)))
        np.testing.assert_allclose(all_scores.numpy(), np.sort(ref)[::-1], atol=1e-5)


@pytest.mark.parametrize("index", ["hnsw", "ivf"])
def test_approximate_search_finds_most_neighbours(data, index):
    db = MemoryVectorDB(48, index)
    db.add(data)
    recall = []
    for q in data[:50] + 0.05:
        exact = set(np.argsort(-cosine_ref(data, q))[:10].tolist())
        approx = [h["index"] for h in db.search(q, 10)]
        assert len(approx) == 10 and db.topk(q, 10)[1].tolist() == approx  # the memory head searches the same way
        recall.append(len(exact & set(approx)) / 10)
    assert np.mean(recall) > 0.8
    assert len(db.search(data[0], len(db) + 5)) == len(db)  # whole bank: exact, clamped


def test_top_k_clamps_and_zero():
    db = MemoryVectorDB(4)
    db.add(np.eye(4, dtype=np.float32) + 0.1)
    assert len(db.search(np.ones(4), 100)) == 4
    assert db.search(np.ones(4), 0) == []
    assert db.topk(np.ones(4), 0)[1].numel() == 0
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        db.search(np.ones(4), -1)


def test_texts_metadata_and_accessors():
    db = MemoryVectorDB(3)
    vecs = np.array([[1, 0, 0], [0, 2, 0], [0, 0, 3]], np.float32)
    assert db.add(vecs, ["a", None, "c"], [{"k": 1}, None, None]) == [0, 1, 2]
    hit = db.search([1, 0.1, 0], 1)[0]
    assert hit["index"] == 0 and hit["text"] == "a" and hit["metadata"] == {"k": 1}
    assert "text" not in db.search([0, 1, 0], 1)[0]
    assert db.text(2) == "c" and db.text(1) is None and db.metadata(0) == {"k": 1}
    assert db.vector(1).tolist() == [0, 2, 0]
    assert db.vector(db.topk([0, 0, 1], 1)[1][0]).tolist() == [0, 0, 3]  # a 0-d id tensor works too
    assert [e["norm"] for e in db.entries(1, 5)] == pytest.approx([2, 3])
    texts = db.texts()
    assert texts == ["a", None, "c"]
    texts.append("not in the bank")  # (a copy)
    db.remove([0])
    assert db.texts() == [None, "c"] and MemoryVectorDB(3).texts() == []


def test_add_and_remove_keep_ids_stable():
    db = MemoryVectorDB(8, "hnsw")
    x = clustered(30, 8, seed=2)
    assert db.add(x[:20], [f"t{i}" for i in range(20)]) == list(range(20))
    assert db.add(x[20:]) == list(range(20, 30))
    assert db.remove([3, 25, 0]) == 27 == len(db)
    assert db.text(4) == "t4" and db.text(26) is None
    np.testing.assert_array_equal(db.vector(29).numpy(), x[29])
    with pytest.raises(KeyError, match="memory id 3 is not in the bank"):
        db.vector(3)
    with pytest.raises(KeyError, match=r"\[3\]"):
        db.remove([3, 4])
    assert len(db) == 27  # a failed remove removes nothing
    assert 25 not in db.topk(x[25], None)[1].tolist()
    assert all(h["index"] not in (0, 3, 25) for h in db.search(x[25], 5))
    assert db.add(x[:1]) == [30]  # ids are never reused
    assert db.topk(x[0], 1)[1].tolist() == [30]
    assert db.remove([i for i in range(1, 31) if i not in (3, 25)]) == 0 and db.topk(x[0], 3)[1].numel() == 0


def test_add_validates_like_loading():
    db = MemoryVectorDB(4)
    bad = np.ones((6, 4), np.float32)
    bad[2, 1], bad[5, 0] = np.nan, np.inf
    with pytest.raises(BankError, match=r"NaN/inf in rows 2, 5"):
        db.add(bad)
    zero = np.ones((4, 4), np.float32)
    zero[1] = 0
    with pytest.raises(BankError, match=r"all-zero rows 1"):
        db.add(zero)
    with pytest.raises(BankError, match="expected vectors of dimension 4, got dimension 5"):
        db.add(np.ones((2, 5)))
    with pytest.raises(BankError, match=r"expected 2 texts \(one per vector\), got 1"):
        db.add(np.ones((2, 4)), ["only one"])
    with pytest.raises(BankError, match="JSON-compatible"):
        db.add(np.ones((1, 4)), metadata=[{"x": object()}])
    with pytest.raises(BankError, match="floating-point"):
        db.add(torch.ones(2, 4, dtype=torch.long))
    assert len(db) == 0


def test_debug_logs_query_and_candidates(caplog, data):
    db = MemoryVectorDB(48)
    db.add(data[:5], ["alpha", "beta", "gamma", "delta", "eps"])
    with caplog.at_level(logging.INFO, logger="memory.bank"):
        hits = db.search(torch.tensor(data[1]), 3, debug=True)
    text = caplog.text
    assert "query shape (48,)" in text and "top_k=3" in text
    assert f"score={hits[2]['score']:.4f}" in text and "'beta'" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memory.bank"):
        db.search(torch.tensor(data[1]), 3)
    assert caplog.text == ""


def test_constructor_checks():
    with pytest.raises(ValueError, match="index must be one of"):
        MemoryVectorDB(4, "annoy")
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        MemoryVectorDB(0)
    with pytest.raises(ValueError, match="hnsw_m must be a positive integer"):
        MemoryVectorDB(4, "hnsw", hnsw_m=0)
    db = MemoryVectorDB(4, "ivf", ivf_nlist=50)
    with pytest.raises(BankError, match="ivf_nlist=50 needs at least 50 vectors"):
        db.add(np.ones((10, 4)))


def test_copy_keeps_ids_and_is_independent():
    db = MemoryVectorDB(4)
    db.add(np.eye(4, dtype=np.float32) + 0.1, texts=["a", "b", "c", "d"], metadata=[{"k": 1}, None, None, None])
    db.remove([1])
    db.info = {"model": "m"}
    twin = db.copy()
    assert [e["index"] for e in twin.entries(0, 9)] == [0, 2, 3] and twin.text(2) == "c"
    assert twin.metadata(0) == {"k": 1} and twin.info == {"model": "m"}
    assert twin.add(np.ones((1, 4), np.float32)) == [4]  # ids continue, never reused
    twin.remove([0])
    assert len(db) == 3 and db.text(0) == "a" and len(twin) == 3
    torch.testing.assert_close(twin.vector(2), db.vector(2))
