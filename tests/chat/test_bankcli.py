"""`python -m chat.bankcli` build / show / search, with a saved tiny model and the real SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from chat.bankcli import main
from memory import MemoryVectorDB

MEMORIES = ["I like green tea in the morning.", "My cat is called Miso.", "The meeting with Anna is on Friday."]


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.model.save_pretrained(folder)
    tiny_llama.tokenizer.save_pretrained(folder)
    return folder


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_build_show_search_with_jsonl(tmp_path, tiny_dir, capsys):
    src = tmp_path / "memories.jsonl"
    src.write_text("\ufeff" + "\n".join(json.dumps({"text": t, "metadata": {"n": i}}) for i, t in enumerate(MEMORIES))
                   + "\n\n")  # (with the byte order mark some editors write: the first line was invalid JSON)
    bank = tmp_path / "bank.pt"
    code, out, _ = run(capsys, "build", src, bank, "--model", tiny_dir, "--values", "state", "--pooling", "mean",
                       "--batch-size", "2")
    assert code == 0 and "saved 3 memories" in out and "one vector of dimension 64 each (key = value)" in out
    per_file = bank.stat().st_size / 3 / 1024  # (on disk, beside what it holds in RAM)
    assert f"{per_file:.1f} KB a memory on disk" in out
    db = MemoryVectorDB.load(bank)
    assert db.metadata(1) == {"n": 1} and db.info["pooling"] == "mean" and db.info["model"] == tiny_dir.name

    code, out, _ = run(capsys, "show", bank, "--n", "2")
    assert code == 0
    assert "3 memories, one vector of dimension 64" in out and "[0] slots=1 key norm=" in out and MEMORIES[1] in out and MEMORIES[2] not in out

    code, out, _ = run(capsys, "search", bank, MEMORIES[2], "--model", tiny_dir, "--k", "2")
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 2
    assert lines[0] == f"1. score=1.0000 [2] {MEMORIES[2]}"  # same text, same spec (mean, read from the bank)


def test_build_and_search_key_value_memories(tmp_path, tiny_dir, capsys):
    """The default for a model never trained to recall: tokens values, keys from the text encoder."""
    src = tmp_path / "memories.txt"
    src.write_text("\n".join(MEMORIES) + "\n")
    bank = tmp_path / "bank.safetensors"
    code, out, _ = run(capsys, "build", src, bank, "--model", tiny_dir, "--value-dtype", "float32")
    assert code == 0 and "tokens values (token ids)" in out and "keys of dimension 384" in out
    db = MemoryVectorDB.load(bank)
    assert db.has_values and db.token_values and db.dim == 384 and db.info["values"] == "tokens"
    ids = [db.values(i) for i in range(3)]  # a slot a token: the memory's own token ids
    assert [len(t) for t in ids] == [e["slots"] for e in db.entries(0, 3)] and min(len(t) for t in ids) > 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert [tokenizer.decode(t) for t in ids] == MEMORIES
    code, out, _ = run(capsys, "search", bank, "Who is Miso?", "--model", tiny_dir, "--k", "1")
    assert code == 0 and out.strip().endswith(f"[1] {MEMORIES[1]}")


def test_a_memory_longer_than_the_app_takes_is_refused_by_its_line_and_nothing_is_written(tmp_path, tiny_dir,
                                                                                         capsys):
    """A CLI-built bank with a memory over `memory.max_slots` was written, then refused by `app.py --bank`: the build
    refuses it, naming the file's line (blank lines counted) and the limit, and writes nothing."""
    src, bank = tmp_path / "memories.txt", tmp_path / "bank.safetensors"
    src.write_text(f"{MEMORIES[0]}\n\n{MEMORIES[1]}\n{' '.join(['word'] * 300)}\n")
    code, _, err = run(capsys, "build", src, bank, "--model", tiny_dir)
    err = err.strip().splitlines()[-1]  # (after the model's loading bar)
    assert code == 2 and err.startswith("error: ")
    assert "memories.txt: expected memories of at most 128 value slots" in err and "got 1 longer: line 4 (" in err
    assert "Nothing was written" in err and not bank.exists()
    code, out, _ = run(capsys, "build", src, bank, "--model", tiny_dir, "--max-slots", "400")  # a larger limit
    assert code == 0 and "saved 3 memories" in out and MemoryVectorDB.load(bank, max_slots=400).token_values


def test_errors_are_one_line_and_exit_2(tmp_path, tiny_dir, capsys):
    code, out, err = run(capsys, "show", tmp_path / "missing.pt")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err

    (tmp_path / "notes.md").write_text("hello")
    code, _, err = run(capsys, "build", tmp_path / "notes.md", tmp_path / "b.pt", "--model", tiny_dir)
    assert code == 2 and "expected a .txt or .jsonl file of memories, got '.md'" in err

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    code, _, err = run(capsys, "build", tmp_path / "bad.jsonl", tmp_path / "b.pt", "--model", tiny_dir)
    assert code == 2 and "bad.jsonl line 2: expected an object with a string 'text'" in err

    small = MemoryVectorDB(8)
    small.add(np.ones((2, 8), np.float32))
    small.save(tmp_path / "small.npy")
    code, _, err = run(capsys, "search", tmp_path / "small.npy", "hi", "--model", tiny_dir)
    assert code == 2 and "expected vectors of dimension 64, got dimension 8" in err

    (tmp_path / "broken.safetensors").write_bytes(b"\x00" * 64)
    code, _, err = run(capsys, "show", tmp_path / "broken.safetensors")
    assert code == 2 and "broken.safetensors: expected a safetensors file, got other bytes" in err


def test_input_errors_name_the_file_and_line(tmp_path, tiny_dir, capsys):
    """A file that is not UTF-8 gave "'utf-8' codec can't decode byte 0xe9 in position 3", and metadata that is not
    an object "add: expected each metadata entry to be a dict, got list at rows 0": neither named file or line."""
    (tmp_path / "memories.txt").write_bytes("Tea at five.\n\nCaf\u00e9 on Friday.\n".encode("latin-1"))
    code, out, err = run(capsys, "build", tmp_path / "memories.txt", tmp_path / "b.pt", "--model", tiny_dir)
    assert code == 2 and out == ""
    assert err == "error: memories.txt line 3: expected UTF-8 text, got byte 0xe9; save the file as UTF-8\n"
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "ok"}).encode()
                                         + b'\r\n{"text": "\xff"}\n')
    code, _, err = run(capsys, "build", tmp_path / "bom.jsonl", tmp_path / "b.pt", "--model", tiny_dir)
    assert code == 2 and "bom.jsonl line 2: expected UTF-8 text, got byte 0xff" in err

    (tmp_path / "meta.jsonl").write_text('{"text": "ok", "metadata": {"n": 1}}\n\n{"text": "no", "metadata": ["n"]}\n')
    code, _, err = run(capsys, "build", tmp_path / "meta.jsonl", tmp_path / "b.pt", "--model", tiny_dir)
    assert code == 2 and err == ("error: meta.jsonl line 3: expected 'metadata' as a JSON object (or left out), "
                                 "got an array\n")
    assert not (tmp_path / "b.pt").exists()


def test_a_npy_for_memories_with_values_is_refused_before_they_are_encoded(tmp_path, tiny_dir, capsys, monkeypatch):
    import models

    (tmp_path / "in.txt").write_text("Tea at five.\n")
    monkeypatch.setattr(models, "build_bank", lambda *a, **k: pytest.fail("the memories were encoded"))
    code, printed, err = run(capsys, "build", tmp_path / "in.txt", tmp_path / "o.npy", "--model", tiny_dir)
    assert code == 2 and printed == "" and not (tmp_path / "o.npy").exists()
    assert ("error: o.npy: a .npy bank holds one vector a memory, and these memories have values of their own "
            "(memory.values tokens): save as .pt or .safetensors") in err, err


def test_a_missing_output_folder_is_named_before_any_work(tmp_path, capsys):
    """The error named mkstemp's temporary ('.../.o.pt.cbihx4da.tmp'), after the model had encoded every memory."""
    (tmp_path / "in.txt").write_text("Tea at five.\n")
    out = tmp_path / "nonexistent" / "dir" / "o.pt"
    code, printed, err = run(capsys, "build", tmp_path / "in.txt", out, "--model", tmp_path / "no-model")  # (unread)
    assert code == 2 and printed == ""
    assert err == f"error: {out.parent}: expected an existing folder for the output, got none\n"
    code, _, err = run(capsys, "export", "http://127.0.0.1:9", out)  # (before the store is reached)
    assert code == 2 and err == f"error: {out.parent}: expected an existing folder for the output, got none\n"


def test_an_output_that_cannot_be_written_is_named_before_any_work(tmp_path, capsys):
    """A folder named bank.pt, or a folder that refuses files, failed after every memory was encoded (28 s for 5,000),
    naming the temporary file; an input folder said "[Errno 21] Is a directory"."""
    (tmp_path / "in.txt").write_text("Tea at five.\n")
    (tmp_path / "dir.pt").mkdir()
    code, printed, err = run(capsys, "build", tmp_path / "in.txt", tmp_path / "dir.pt", "--model", tmp_path / "none")
    assert code == 2 and printed == "" and err == f"error: {tmp_path / 'dir.pt'}: expected a file name for the " \
                                                  "output, got a folder\n"
    code, _, err = run(capsys, "build", tmp_path / "in.txt", "/proc/o.pt", "--model", tmp_path / "none")
    assert code == 2 and err.startswith("error: /proc: expected a folder the output can be written in, got one that "
                                        "refuses it (")
    code, _, err = run(capsys, "build", tmp_path / "dir.pt", tmp_path / "o.pt", "--model", tmp_path / "none")
    assert code == 2 and err == f"error: {tmp_path / 'dir.pt'}: expected a text file of memories, got a folder\n"
    code, _, err = run(capsys, "show", tmp_path / "dir.pt")
    assert code == 2 and err == "error: dir.pt: expected a PyTorch .pt memory bank file, got a folder\n"


@pytest.mark.parametrize("argv, message", [
    (["show", "bank.pt", "--n", "-1"], "argument --n: expected an integer >= 0, got -1"),
    (["search", "bank.pt", "tea", "--k", "0"], "argument --k: expected an integer >= 1, got 0"),
    (["search", "bank.pt", "tea", "--k", "two"], "argument --k: expected an integer >= 1, got 'two'"),
    (["build", "in.txt", "bank.pt", "--batch-size", "0"], "argument --batch-size: expected an integer >= 1, got 0"),
])
def test_counts_out_of_range_are_refused_before_anything_is_printed(tmp_path, capsys, argv, message):
    """`show --n -1` printed the bank's header, then "start and count must be >= 0"; `search --k 0` printed nothing
    and exited 0."""
    bank = MemoryVectorDB(8)
    bank.add(np.ones((2, 8), np.float32), ["a", "b"])
    bank.save(tmp_path / "bank.pt")
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path / a) if a.endswith((".pt", ".txt")) else a for a in argv])
    out = capsys.readouterr()
    assert info.value.code == 2 and out.out == "" and out.err.strip().splitlines()[-1].endswith(message)


def test_show_n_0_prints_the_header_and_search_help_says_k_is_at_least_1(tmp_path, capsys):
    bank = MemoryVectorDB(8)
    bank.add(np.ones((2, 8), np.float32), ["a", "b"])
    bank.save(tmp_path / "bank.pt")
    code, printed, _ = run(capsys, "show", tmp_path / "bank.pt", "--n", "0")
    assert code == 0 and printed.startswith(f"{tmp_path / 'bank.pt'}: 2 memories") and "[0]" not in printed
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    assert "--k K memories to print, best first: 1 or more (0 is refused;" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_cli_with_embedded_smollm2(tmp_path, smollm2_dir):
    """The real default model, run as a module in a subprocess, as a user would."""
    src = tmp_path / "memories.txt"
    src.write_text("\n".join(MEMORIES) + "\n\n")
    bank = tmp_path / "bank.safetensors"
    cli = [sys.executable, "-m", "chat.bankcli"]
    env_run = dict(capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    built = subprocess.run([*cli, "build", str(src), str(bank)], **env_run)
    assert built.returncode == 0, built.stderr
    assert "saved 3 memories" in built.stdout and "tokens values (token ids)" in built.stdout
    found = subprocess.run([*cli, "search", str(bank), MEMORIES[1], "--k", "3"], **env_run)
    assert found.returncode == 0, found.stderr
    lines = found.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[0] == f"1. score=1.0000 [1] {MEMORIES[1]}"
    scores = [float(line.split("score=")[1].split()[0]) for line in lines]
    assert scores == sorted(scores, reverse=True) and scores[2] < 0.99
    shown = subprocess.run([*cli, "show", str(bank)], **env_run)
    assert "3 memories, tokens values (token ids)" in shown.stdout and "keys of dimension 384" in shown.stdout
    assert '"model": "SmolLM2-135M-Instruct + recall-smollm2"' in shown.stdout  # the shipped adapter's encoder


@pytest.mark.slow
def test_layer_and_pooling_the_encoder_would_ignore_are_refused_and_nothing_is_written(tmp_path, tiny_dir, capsys):
    """(`--layer 3 --pooling mean` built a bank of the shipped adapter's token values as if they were not given.)
    They choose the hidden state of state values: with values of another kind, or with the recall adapter's own
    layer and pooling, they are refused by name; with state values of a plain model they are written."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(MEMORIES) + "\n")
    bank = tmp_path / "b.pt"
    code, _, err = run(capsys, "build", src, bank, "--model", tiny_dir, "--pooling", "mean")
    assert code == 2 and ("error: --pooling mean: these choose the hidden state of state values, and these memories "
                          "are tokens values with keys of their own (--values auto)") in err
    code, _, err = run(capsys, "build", src, bank, "--layer", "3", "--values", "state")  # (the embedded model)
    assert code == 2 and "--layer 3: the recall adapter's encoder reads layer" in err and not bank.exists()
    code, out, _ = run(capsys, "build", src, bank, "--model", tiny_dir, "--values", "state", "--layer", "1")
    assert code == 0 and MemoryVectorDB.load(bank).info["layer"] == 1


def test_build_reads_one_memory_a_line_refuses_questions_and_checks_the_output_first(tmp_path, tiny_dir, capsys):
    """A form feed or U+2028 inside a line split it in two (and shifted the line numbers of errors); a line of
    zero-width or control characters was a memory; a question was a memory that a search for the same question read
    instead of the fact; an output of another type was refused after every line was encoded (41 s for 5,250)."""
    src = tmp_path / "odd.txt"
    src.write_text("Line with a form\x0cfeed inside.\r\nOne\u2028Two.\n\u200b\n\x00\nThe ferry leaves at seven.\n"
                   "One\u2028Two.\n")  # (and a line again: kept once, as the page's write keeps it)
    bank = tmp_path / "odd.pt"
    code, out, err = run(capsys, "build", src, bank, "--model", tiny_dir, "--values", "state")
    assert code == 0 and "1 line(s) repeat an earlier one and are kept once: line(s) 6" in out, err
    assert MemoryVectorDB.load(bank).texts() == ["Line with a form\x0cfeed inside.", "One\u2028Two.",
                                                 "The ferry leaves at seven."]
    src.write_text("Zorbel Quint is the harbour master.\n\nWho is the harbour master of Tessaly?\n")
    code, _, err = run(capsys, "build", src, tmp_path / "q.pt", "--model", tiny_dir, "--values", "state")
    assert code == 2 and "odd.txt line 3: expected statements" in err and "'Who is the harbour master" in err
    assert not (tmp_path / "q.pt").exists()
    code, _, err = run(capsys, "build", src, tmp_path / "bank.txt2", "--model", tmp_path / "no-such-model")
    assert code == 2 and "bank.txt2: expected a memory bank file ending in .pt, .safetensors or .npy" in err
    (tmp_path / "empty.jsonl").write_text('{"text": "A fact."}\n{"text": " "}\n')  # (refused as "rows [1]", later)
    code, _, err = run(capsys, "build", tmp_path / "empty.jsonl", tmp_path / "e.pt", "--model", tmp_path / "none")
    assert code == 2 and "empty.jsonl line 2: expected a 'text' to remember, got ' '" in err
