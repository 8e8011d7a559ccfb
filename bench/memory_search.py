"""Memory bank search speed: exact top-k vs FAISS HNSW / IVF, build and load times, ANN recall@10.

    .venv/bin/python bench/memory_search.py [--queries 200] [--max-gib 8] [--sizes 10000,100000,1000000]

Data: unit float32 vectors in 1000 Gaussian clusters (fixed seed), queries drawn the same way but
not in the bank, so neighbours are real and recall means something. Latency is one query at a
time (as a recall in the generation loop), median over the queries. "exact" is
`MemoryVectorDB.topk` (always exact; the path the generation loop uses), "faiss flat" is FAISS's
exact kernel (`faiss.knn`, what `IndexFlatIP.search` runs) on the same matrix for reference,
"search()" is `MemoryVectorDB.search(top_k=10)` on a flat bank including building its result dicts.
HNSW / IVF times are `memory.ann.AnnIndex` (what `MemoryVectorDB.search` calls) built over the
same unit vectors; recall@10 is against exact search. Sizes whose peak memory would pass
--max-gib are skipped and listed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import MemoryVectorDB  # noqa: E402
from memory.ann import AnnConfig, AnnIndex, auto_nlist  # noqa: E402

DIMS = (576, 2560)
CLUSTERS = 1000
SPREAD = 0.7  # noise norm relative to the unit cluster centre: cos(point, centre) ~ 0.82


def clustered_unit(n: int, dim: int, seed: int, chunk: int = 50_000) -> np.ndarray:
    """[n, dim] float32 unit vectors around CLUSTERS fixed centres."""
    centres = np.random.default_rng(12345 + dim).standard_normal((CLUSTERS, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    out = np.empty((n, dim), np.float32)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        block = centres[rng.integers(0, CLUSTERS, m)]
        block += rng.standard_normal((m, dim), dtype=np.float32) * np.float32(SPREAD / np.sqrt(dim))
        out[s:s + m] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def median_ms(fn, queries: np.ndarray) -> float:
    fn(queries[0])  # warm-up
    times = []
    for q in queries:
        t = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def recall_at_10(ann: AnnIndex, queries: np.ndarray, truth: np.ndarray, n: int) -> float:
    hits = [len(set(ann.search(q, 10, n)[1].tolist()) & set(t.tolist())) for q, t in zip(queries, truth)]
    return sum(hits) / (10 * len(queries))


def peak_gib(n: int, dim: int, hnsw_m: int) -> float:
    """Largest phase: source + bank (raw + normalised), or source + ANN (vectors + HNSW links)."""
    vec = n * dim * 4
    return max(3 * vec, 2 * vec + n * 2 * hnsw_m * 4 * 1.1) / 2**30


def run_case(dim: int, n: int, n_queries: int, hnsw_m: int) -> dict[str, str]:
    row: dict[str, str] = {"D": str(dim), "N": f"{n:,}"}
    data, gen_s = timed(lambda: clustered_unit(n, dim, seed=1))
    queries = clustered_unit(n_queries, dim, seed=2)
    exact_queries = queries[: max(20, n_queries // 4)] if n >= 1_000_000 else queries
    truth = faiss.knn(queries, data, 10, metric=faiss.METRIC_INNER_PRODUCT)[1]  # exact, batched

    db = MemoryVectorDB(dim)
    _, row["add s"] = timed(lambda: db.add(data))
    row["add s"] = f"{row['add s']:.2f}"
    if n == 100_000:
        with tempfile.TemporaryDirectory() as tmp:
            db.save(Path(tmp) / "bank.npy")
            _, load_s = timed(lambda: MemoryVectorDB.load(Path(tmp) / "bank.npy"))
        row["load .npy s"] = f"{load_s:.2f}"
    assert np.array_equal(db.topk(queries[0], 10)[1].numpy(), truth[0])
    row["exact ms"] = f"{median_ms(lambda q: db.topk(q, 10), exact_queries):.2f}"
    flat = lambda q: faiss.knn(q[None], data, 10, metric=faiss.METRIC_INNER_PRODUCT)  # noqa: E731
    row["faiss flat ms"] = f"{median_ms(flat, exact_queries):.2f}"
    row["search() ms"] = f"{median_ms(lambda q: db.search(q, 10), exact_queries):.2f}"
    del db
    gc.collect()

    for kind, config in (("HNSW", AnnConfig("hnsw", hnsw_m=hnsw_m)), ("IVF", AnnConfig("ivf"))):
        ann = AnnIndex(config, dim)
        _, build_s = timed(lambda: ann.add(data))
        row[f"{kind} build s"] = f"{build_s:.1f}"
        row[f"{kind} ms"] = f"{median_ms(lambda q: ann.search(q, 10, n), queries):.3f}"
        row[f"{kind} R@10"] = f"{recall_at_10(ann, queries, truth, n):.3f}"
        del ann
        gc.collect()
    print(f"  done D={dim} N={n:,} (data {gen_s:.1f} s, {len(exact_queries)} exact / {len(queries)} ANN queries)",
          file=sys.stderr, flush=True)
    return row


def memory_head(n: int, n_queries: int, hnsw_m: int, efs: list[int]) -> None:
    """The memory head (`MemorySelector`, greedy, top_k=5) over an N x 576 bank: exact vs through HNSW."""
    import torch

    from decoding import MemorySelector, RecallSettings

    data = clustered_unit(n, 576, seed=1)
    queries = torch.from_numpy(clustered_unit(n_queries, 576, seed=2))
    flat = MemoryVectorDB(576)
    flat.add(data)
    selector = MemorySelector(flat, RecallSettings(top_k=5))
    truth = [selector.choose(q).index for q in queries]
    rows = [("exact (flat)", "—", median_ms(selector.choose, queries[:50]), 1.0)]
    del flat, selector
    gc.collect()
    for ef in efs:
        db = MemoryVectorDB(576, "hnsw", hnsw_m=hnsw_m, hnsw_ef_search=ef)
        _, build_s = timed(lambda: db.add(data))
        selector = MemorySelector(db, RecallSettings(top_k=5))
        hits = sum(selector.choose(q).index == t for q, t in zip(queries, truth)) / len(truth)
        rows.append((f"HNSW M={hnsw_m} efSearch={ef}", f"{build_s:.0f}", median_ms(selector.choose, queries), hits))
        del db, selector
        gc.collect()
    print(f"memory head at N={n:,} x 576, one query at a time, median of {n_queries} (recall@1 = same memory as "
          "exact greedy)\n")
    print("| search | build s | memory head ms | recall@1 vs exact |\n|---|---|---|---|")
    for name, build, ms, r in rows:
        print(f"| {name} | {build} | {ms:.3f} | {r:.3f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-head", type=int, default=0, metavar="N",
                   help="instead: the memory head over N memories, exact vs HNSW (e.g. 1000000)")
    p.add_argument("--ef", default="64,128,256", help="HNSW efSearch values for --memory-head")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--max-gib", type=float, default=8.0)
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--hnsw-m", type=int, default=32)
    args = p.parse_args(argv)
    if args.memory_head:
        return memory_head(args.memory_head, args.queries, args.hnsw_m, [int(e) for e in args.ef.split(",")])
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, skipped = [], []
    start = time.perf_counter()
    for dim in DIMS:
        for n in sizes:
            need = peak_gib(n, dim, args.hnsw_m)
            if need > args.max_gib:
                skipped.append(f"D={dim} N={n:,}: needs ~{need:.1f} GiB at peak, over --max-gib {args.max_gib:g}")
                continue
            rows.append(run_case(dim, n, args.queries, args.hnsw_m))
    cols = ["D", "N", "add s", "load .npy s", "exact ms", "faiss flat ms", "search() ms",
            "HNSW build s", "HNSW ms", "HNSW R@10", "IVF build s", "IVF ms", "IVF R@10"]
    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} threads; HNSW M={args.hnsw_m} efSearch=64; "
          f"IVF nlist=sqrt(N) nprobe=sqrt(nlist) (e.g. N=100k: nlist={auto_nlist(100_000)})\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r.get(c, "—") for c in cols) + " |")
    for s in skipped:
        print(f"\nskipped {s}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
