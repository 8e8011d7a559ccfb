"""Bank files: round trips, atomic save, hostile and broken files."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import safetensors.torch
import torch

import memory.files
from memory import BankCheck, BankError, MemoryVectorDB


def vectors(n: int = 6, dim: int = 8, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, dim)) * 3).astype(np.float32)


def labelled_db(index: str = "flat") -> MemoryVectorDB:
    db = MemoryVectorDB(8, index)
    db.add(vectors(), [f"memory {i}" for i in range(5)] + [None], [{"i": i, "tags": ["x"]} for i in range(6)])
    db.info = {"layer": -1, "pooling": "last"}
    return db


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_round_trip_keeps_vectors_texts_metadata_info(tmp_path, ext):
    db = labelled_db()
    path = tmp_path / f"bank{ext}"
    db.save(path)
    back = MemoryVectorDB.load(path, index="hnsw")
    assert (len(back), back.dim, back.index) == (6, 8, "hnsw")
    np.testing.assert_array_equal(torch.stack([back.vector(i) for i in range(6)]).numpy(), vectors())
    assert [back.text(i) for i in range(6)] == [f"memory {i}" for i in range(5)] + [None]
    assert back.metadata(3) == {"i": 3, "tags": ["x"]}
    assert back.info == {"layer": -1, "pooling": "last"}
    assert back.search(vectors()[2], 1)[0]["text"] == "memory 2"


def test_npy_round_trip_keeps_vectors_only(tmp_path):
    path = tmp_path / "bank.npy"
    labelled_db().save(path)
    back = MemoryVectorDB.load(path)
    np.testing.assert_array_equal(back.topk(vectors()[4], 1)[1].numpy(), [4])
    np.testing.assert_array_equal(back.vector(5).numpy(), vectors()[5])
    assert back.text(0) is None and back.metadata(0) is None


def test_ids_are_renumbered_by_save_load(tmp_path):
    db = labelled_db()
    db.remove([0, 2])
    db.save(tmp_path / "bank.pt")
    back = MemoryVectorDB.load(tmp_path / "bank.pt")
    assert [e["index"] for e in back.entries(0, 10)] == [0, 1, 2, 3]
    assert [e["text"] for e in back.entries(0, 10)] == ["memory 1", "memory 3", "memory 4", None]


@pytest.mark.parametrize("payload", [
    lambda v: v,  # tensor [N, D]
    lambda v: list(v),  # list of [D] tensors
    lambda v: {"embeddings": list(v), "texts": [str(i) for i in range(len(v))]},
    lambda v: {"embeddings": v.to(torch.bfloat16)},
])
def test_pt_layouts(tmp_path, payload):
    v = torch.from_numpy(vectors())
    torch.save(payload(v), tmp_path / "bank.pt")
    db = MemoryVectorDB.load(tmp_path / "bank.pt", check=BankCheck(dim=8))
    assert len(db) == 6
    assert db.topk(v[3], 1)[1].item() == 3


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "bank.pt"
    labelled_db().save(path)
    before = path.read_bytes()

    def broken_save(obj, fh):
        fh.write(b"half a bank")
        raise RuntimeError("disk full")

    monkeypatch.setattr(memory.files.torch, "save", broken_save)
    other = MemoryVectorDB(8)
    other.add(vectors(3, seed=9))
    with pytest.raises(RuntimeError, match="disk full"):
        other.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["bank.pt"]
    monkeypatch.undo()
    assert MemoryVectorDB.load(path).text(0) == "memory 0"


def test_save_is_atomic_when_fsync_fails(tmp_path, monkeypatch):
    path = tmp_path / "bank.safetensors"
    labelled_db().save(path)
    before = path.read_bytes()

    def no_fsync(fd):
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", no_fsync)
    other = MemoryVectorDB(8)
    other.add(vectors(3, seed=9))
    with pytest.raises(OSError, match="I/O error"):
        other.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["bank.safetensors"]


def test_save_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "bank.pt"
    labelled_db().save(path)
    small = MemoryVectorDB(8)
    small.add(vectors(2, seed=3))
    small.save(path)
    assert len(MemoryVectorDB.load(path)) == 2
    assert os.listdir(tmp_path) == ["bank.pt"]


def test_save_into_a_missing_folder_names_the_folder_not_a_temporary(tmp_path):
    path = tmp_path / "missing" / "bank.pt"
    with pytest.raises(FileNotFoundError) as info:
        labelled_db().save(path)
    assert str(info.value) == f"{path.parent}: expected an existing folder for bank.pt, got none"
    (tmp_path / "plain").write_text("a file")
    with pytest.raises(FileNotFoundError, match="expected an existing folder for bank.pt, got a file"):
        labelled_db().save(tmp_path / "plain" / "bank.pt")
    assert sorted(os.listdir(tmp_path)) == ["plain"]


class Payload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_pickle_payload_disguised_as_pt_never_runs(tmp_path, writer):
    marker = tmp_path / "MARKER"
    path = tmp_path / "bank.pt"
    if writer == "torch.save":
        torch.save({"embeddings": torch.ones(2, 8), "texts": Payload(marker)}, path)
    else:  # a bare pickle (torch's legacy format), protocol 2 as torch's unpickler reads it
        path.write_bytes(pickle.dumps({"embeddings": [[1.0] * 8], "texts": Payload(marker)}, protocol=2))
    # Control: an unsafe load really does run the payload, so the file is live.
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()
    marker.unlink()

    with pytest.raises(BankError, match=r"bank\.pt: expected a readable PyTorch \.pt file.*nothing run") as caught:
        MemoryVectorDB.load(path)
    assert not marker.exists()
    assert "system" in str(caught.value) and "weights_only" not in str(caught.value)


def test_pickled_npy_never_runs(tmp_path):
    marker = tmp_path / "MARKER"
    path = tmp_path / "bank.npy"
    np.save(path, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(BankError, match=r"bank\.npy: expected a readable NumPy \.npy file"):
        MemoryVectorDB.load(path)
    assert not marker.exists()


def save_pt(tmp_path, obj, name="bank.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return path


def test_wrong_dimension_names_both(tmp_path):
    path = save_pt(tmp_path, torch.ones(3, 64))
    with pytest.raises(BankError, match=r"bank\.pt: expected vectors of dimension 576, got dimension 64"):
        MemoryVectorDB.load(path, check=BankCheck(dim=576))


def test_nan_rows_are_named(tmp_path):
    v = torch.ones(10, 8)
    v[3, 2], v[7, 0] = float("nan"), float("-inf")
    path = save_pt(tmp_path, {"embeddings": v})
    with pytest.raises(BankError, match=r"bank\.pt: expected finite vectors, got NaN/inf in rows 3, 7$"):
        MemoryVectorDB.load(path)


def test_many_bad_rows_are_summarised(tmp_path):
    v = torch.ones(20, 8)
    v[2:15] = float("nan")
    with pytest.raises(BankError, match=r"rows 2, 3, 4, 5, 6, \.\.\. \(13 rows in all\)"):
        MemoryVectorDB.load(save_pt(tmp_path, v))


def test_zero_rows_are_named(tmp_path):
    v = torch.ones(5, 8)
    v[4] = 0
    with pytest.raises(BankError, match=r"all-zero rows 4$"):
        MemoryVectorDB.load(save_pt(tmp_path, v))


@pytest.mark.parametrize("obj", [torch.empty(0, 8), [], {"embeddings": []}])
def test_empty_bank(tmp_path, obj):
    with pytest.raises(BankError, match=r"empty bank \(0 rows\)"):
        MemoryVectorDB.load(save_pt(tmp_path, obj))


def test_empty_npy_bank(tmp_path):
    np.save(tmp_path / "bank.npy", np.empty((0, 8), np.float32))
    with pytest.raises(BankError, match=r"bank\.npy: .*empty bank \(0 rows\)"):
        MemoryVectorDB.load(tmp_path / "bank.npy")


@pytest.mark.parametrize("ext", [".pt", ".safetensors", ".npy"])
def test_empty_file(tmp_path, ext):
    path = tmp_path / f"bank{ext}"
    path.write_bytes(b"")
    with pytest.raises(BankError, match=rf"bank{ext}: expected a .* memory bank, got an empty file \(0 bytes\)"):
        MemoryVectorDB.load(path)


@pytest.mark.parametrize("ext", [".pt", ".safetensors", ".npy"])
def test_a_folder_is_no_bank(tmp_path, ext):
    """`app.py --bank dir.pt` stopped with a traceback and "IsADirectoryError: [Errno 21] Is a directory"."""
    (tmp_path / f"bank{ext}").mkdir()
    with pytest.raises(BankError, match=rf"^bank{ext}: expected a .* memory bank file, got a folder$"):
        MemoryVectorDB.load(tmp_path / f"bank{ext}")


@pytest.mark.parametrize("ext, fmt", [(".pt", "PyTorch .pt"), (".safetensors", "safetensors"), (".npy", "NumPy .npy")])
def test_corrupt_file(tmp_path, ext, fmt):
    """Bytes of no format, text (a probe's text file named .pt said "corrupt or refused one (KeyError: 101)"), and the
    right start with nothing readable after it."""
    path = tmp_path / f"bank{ext}"
    path.write_bytes(b"\x00" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(BankError, match=rf"bank{ext}: expected a {fmt} file, got other bytes \(starting b'\\x00"):
        MemoryVectorDB.load(path)
    path.write_text("embedding,text\n0.1,hello\n")
    with pytest.raises(BankError, match=rf"bank{ext}: expected a {fmt} file, got text \('embedding,te'...\); not "
                                        "loaded"):
        MemoryVectorDB.load(path)
    start = {".pt": b"PK\x03\x04", ".safetensors": b"\x10" + bytes(7) + b"{", ".npy": b"\x93NUMPY"}[ext]
    path.write_bytes(start + bytes(100))
    with pytest.raises(BankError, match=rf"bank{ext}: expected a readable {fmt} file, got a corrupt or refused one"):
        MemoryVectorDB.load(path)


def test_truncated_pt(tmp_path):
    path = save_pt(tmp_path, torch.ones(100, 8))
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(BankError, match="corrupt or refused"):
        MemoryVectorDB.load(path)


@pytest.mark.parametrize("obj, message", [
    ({"vectors": torch.ones(2, 8)}, r"expected a dict with key 'embeddings', got keys \['vectors'\]"),
    ({"embeddings": torch.ones(2, 8), "text": ["a", "b"]}, r"unknown keys \['text'\]"),
    ({"embeddings": "nope"}, "expected 'embeddings' as a tensor"),
    (torch.ones(2, 3, 8), r"expected a 2-D array of vectors \[N, D\], got shape \(2, 3, 8\)"),
    ({"embeddings": torch.ones(3, 8), "texts": ["a", "b"]}, r"expected 3 texts \(one per vector\), got 2"),
    ({"embeddings": torch.ones(2, 8), "metadata": [1, 2]}, "expected each metadata entry to be a dict, got int"),
    ([torch.ones(8), torch.ones(7)], "expected all vectors of dimension 8, got 7 at item 1"),
    ([torch.ones(8), torch.ones(2, 8)], r"expected a list of 1-D \[D\] tensors, got shape \(2, 8\) at item 1"),
    ("just a string", "expected a tensor .*, got str"),
    (torch.ones(2, 8, dtype=torch.int64), "expected floating-point vectors, got dtype torch.int64"),
    # (accepted, then its .safetensors download failed: the info is saved there as JSON)
    ({"embeddings": torch.ones(2, 8), "info": {"x": torch.zeros(2)}},
     "expected 'info' of JSON values .* Tensor is not JSON serializable"),
])
def test_unknown_layout(tmp_path, obj, message):
    with pytest.raises(BankError, match=message):
        MemoryVectorDB.load(save_pt(tmp_path, obj))


def test_safetensors_layouts(tmp_path):
    path = tmp_path / "bank.safetensors"
    safetensors.torch.save_file({"vectors": torch.ones(2, 8)}, path)
    with pytest.raises(BankError, match=r"expected a tensor named 'embeddings', got tensors \['vectors'\]"):
        MemoryVectorDB.load(path)
    safetensors.torch.save_file({"embeddings": torch.ones(2, 8)}, path, metadata={"texts": "[not json"})
    with pytest.raises(BankError, match="expected JSON in safetensors metadata 'texts'"):
        MemoryVectorDB.load(path)


def test_npy_layouts(tmp_path):
    np.save(tmp_path / "bank.npy", np.ones(8, np.float32))
    with pytest.raises(BankError, match=r"got shape \(8,\)"):
        MemoryVectorDB.load(tmp_path / "bank.npy")
    np.save(tmp_path / "bank.npy", np.ones((2, 8), np.int32))
    with pytest.raises(BankError, match="floating-point vectors, got dtype int32"):
        MemoryVectorDB.load(tmp_path / "bank.npy")


def test_too_large(tmp_path):
    path = save_pt(tmp_path, torch.ones(100, 8))
    size = path.stat().st_size
    with pytest.raises(BankError, match=rf"bank\.pt: file is {size} bytes, over the limit of 1000 bytes"):
        MemoryVectorDB.load(path, max_bytes=1000)
    assert len(MemoryVectorDB.load(path, max_bytes=size)) == 100


def test_unknown_extension_and_missing_file(tmp_path):
    path = tmp_path / "bank.bin"
    path.write_bytes(b"x")
    with pytest.raises(BankError, match=r"bank\.bin: expected a memory bank file ending in .pt, .safetensors or .npy"):
        MemoryVectorDB.load(path)
    with pytest.raises(BankError, match="got '.json'"):
        labelled_db().save(tmp_path / "bank.json")
    with pytest.raises(FileNotFoundError):
        MemoryVectorDB.load(tmp_path / "missing.pt")


# --------------------------------------------------------------------------- key/value memories


def kv_db(dtype: str = "float16") -> MemoryVectorDB:
    """Five memories with 8-d keys and 1..5 value slots of dimension 6."""
    rng = np.random.default_rng(4)
    db = MemoryVectorDB(8, value_dim=6, value_dtype=dtype)
    db.add(vectors(5), [f"memory {i}" for i in range(5)],
           values=[rng.standard_normal((k, 6)).astype(np.float32) for k in (1, 2, 3, 4, 5)])
    db.info = {"values": "tokens", "keys": "a text encoder"}
    return db


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_key_value_round_trip_keeps_keys_values_and_their_dtype(tmp_path, ext, dtype):
    db = kv_db(dtype)
    db.remove([1])  # compacted: the other memories keep their values
    db.save(tmp_path / f"kv{ext}")
    back = MemoryVectorDB.load(tmp_path / f"kv{ext}", check=BankCheck(dim=6, key_dim=8), max_slots=5)
    assert back.has_values and back.value_dim == 6 and back.info == db.info and len(back) == 4
    assert [e["slots"] for e in back.entries(0, 4)] == [1, 3, 4, 5]
    for new, old in enumerate((0, 2, 3, 4)):
        assert torch.equal(back.values(new), db.values(old)) and torch.equal(back.vector(new), db.vector(old))
        assert back.memory(new, 0.5).slots == len(db.values(old))
    per_memory = 2 * 4 * 8 + (1 + 3 + 4 + 5) * 6 * (2 if dtype == "float16" else 4) / 4
    assert back.bytes_per_memory() == pytest.approx(per_memory)


def test_a_bank_without_values_loads_as_key_equals_value_one_slot(tmp_path):
    db = labelled_db()
    db.save(tmp_path / "old.pt")
    back = MemoryVectorDB.load(tmp_path / "old.pt", check=BankCheck(dim=8), max_slots=1)
    assert not back.has_values and back.value_dim == 8
    assert torch.equal(back.values(2), back.vector(2)[None]) and back.entries(0, 1)[0]["slots"] == 1


def test_values_cannot_go_to_npy(tmp_path):
    with pytest.raises(BankError, match="a .npy bank holds keys only.*save as .pt or .safetensors"):
        kv_db().save(tmp_path / "kv.npy")
    assert not list(tmp_path.iterdir())  # nothing half-written


def kv_file(tmp_path, ext=".pt", **change):
    """A key/value bank file whose tensors are replaced by `change`."""
    db = kv_db()
    tensors = {"embeddings": torch.from_numpy(vectors(5)), "values": torch.from_numpy(db._snap.values.copy()),
               "value_offsets": torch.from_numpy(db._snap.offsets.copy())}
    tensors.update(change)
    path = tmp_path / f"bad{ext}"
    if ext == ".pt":
        torch.save({k: v for k, v in tensors.items() if v is not None}, path)
    else:
        safetensors.torch.save_file({k: v for k, v in tensors.items() if v is not None}, str(path))
    return path


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
@pytest.mark.parametrize("change, message", [
    ({"value_offsets": torch.tensor([0, 1, 3, 6, 10, 99])}, "offsets from 0 to 15 .* got 0 to 99"),
    ({"value_offsets": torch.tensor([0, 3, 1, 6, 10, 15])}, "strictly increasing .* rows 1"),
    ({"value_offsets": torch.tensor([0, 1, 3, 6, 15])}, "expected 6 value offsets .* got 5"),
    ({"value_offsets": torch.tensor([0.0, 1, 3, 6, 10, 15])}, "1-D integer array"),
    ({"value_offsets": None}, "'values' and 'value_offsets' together, got only values"),
    ({"values": torch.full((15, 6), float("nan"))}, "finite values, got NaN/inf in the values of memories 0, 1, 2, 3, 4"),
    ({"values": torch.zeros(15, 7)}, "value vectors of dimension 6, got dimension 7"),
    ({"embeddings": torch.zeros(5, 9) + 1}, "dimension 8, got dimension 9"),
])
def test_bad_key_value_files_are_refused_by_name(tmp_path, ext, change, message):
    path = kv_file(tmp_path, ext, **change)
    with pytest.raises(BankError, match=message):
        MemoryVectorDB.load(path, check=BankCheck(dim=6, key_dim=8))


def test_too_many_slots_are_refused_with_the_cap(tmp_path):
    kv_db().save(tmp_path / "kv.pt")
    with pytest.raises(BankError, match=r"at most 4 value slots per memory \(memory.max_slots\), got 5 at rows 4"):
        MemoryVectorDB.load(tmp_path / "kv.pt", max_slots=4)


def test_add_checks_values():
    db = MemoryVectorDB(8, value_dim=6)
    with pytest.raises(BankError, match="expected values for every memory"):
        db.add(vectors(2))
    with pytest.raises(BankError, match="expected 2 value arrays"):
        db.add(vectors(2), values=[np.ones((1, 6))])
    with pytest.raises(BankError, match="value vectors of dimension 6, got dimension 5"):
        db.add(vectors(2), values=[np.ones((1, 5)), np.ones((2, 5))])
    with pytest.raises(BankError, match="expected no values"):
        MemoryVectorDB(8).add(vectors(1), values=[np.ones((1, 8))])
    assert len(db) == 0  # nothing half-added


# --------------------------------------------------------------------------- token values


def token_db() -> MemoryVectorDB:
    """Four memories with 8-d keys and 2..5 token ids each (a bank of `tokens` values)."""
    db = MemoryVectorDB(8, token_values=True)
    db.add(vectors(4), [f"memory {i}" for i in range(4)],
           values=[torch.arange(k) + 10 * k for k in (2, 3, 4, 5)])
    db.info = {"values": "tokens", "keys": "a text encoder", "encoder": "model/tokens/keys"}
    return db


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
def test_token_values_round_trip_as_ids_at_four_bytes_a_slot(tmp_path, ext):
    db = token_db()
    db.remove([1])
    db.save(tmp_path / f"tok{ext}")
    back = MemoryVectorDB.load(tmp_path / f"tok{ext}", check=BankCheck(dim=576, key_dim=8), vocab_size=100)
    assert back.has_values and back.token_values and back.value_dim is None and len(back) == 3
    for new, old in enumerate((0, 2, 3)):
        ids = back.values(new)
        assert ids.dtype == torch.int64 and torch.equal(ids, db.values(old))
        memory = back.memory(new, 0.5)
        assert memory.token_ids and memory.slots == len(ids)
    assert back.bytes_per_memory() == pytest.approx(2 * 4 * 8 + 4 * (2 + 4 + 5) / 3)
    copy = back.copy()
    assert copy.token_values and torch.equal(copy.values(2), back.values(2))


def test_token_values_outside_the_vocabulary_and_wrong_kinds_are_refused(tmp_path):
    token_db().save(tmp_path / "tok.pt")
    with pytest.raises(BankError, match=r"token ids from 0 to 39 .*got 40 in the values of memories 2"):
        MemoryVectorDB.load(tmp_path / "tok.pt", vocab_size=40)
    bad = {"embeddings": torch.from_numpy(vectors(2)), "values": torch.tensor([[1, 2], [3, 4]]),
           "value_offsets": torch.tensor([0, 1, 2])}
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(BankError, match=r"token ids as a 1-D array \[slots\], got shape \(2, 2\)"):
        MemoryVectorDB.load(tmp_path / "bad.pt")
    db = MemoryVectorDB(8, token_values=True)
    with pytest.raises(BankError, match=r"as token ids \[k\]"):
        db.add(vectors(1), values=[np.ones((1, 6), np.float32)])
    with pytest.raises(BankError, match=r"token ids from 0 to .* got -3"):
        db.add(vectors(1), values=[torch.tensor([1, -3])])
    with pytest.raises(BankError, match=r"2-D float array \[k, 6\]"):
        MemoryVectorDB(8, value_dim=6).add(vectors(1), values=[torch.tensor([1, 2])])
    assert len(db) == 0
