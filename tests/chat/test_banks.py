"""A session's banks (`chat.banks`) as the page uses them: upload errors, writes of lines already in the bank, the
download format's note."""

from __future__ import annotations

import gradio as gr
import numpy as np
import pytest
import torch

from chat.banks import Written
from chat.config import load_config
from chat.service import Service
from chat.worker import ServiceError
from memory import BankError, MemoryVectorDB
from page.layout import _memory_tab
from tests_helpers import bank_file, result


def config(*overrides: str):
    return load_config(overrides=["generation.max_new_tokens=8", "model.compile=false", *overrides], environ={})


@pytest.fixture
def service(tiny_llama):
    svc = Service(config(), tiny_llama)
    yield svc
    svc.close()


def test_upload_errors_name_the_hidden_size_only_beside_a_dimension_that_does_not_fit(tmp_path, service):
    """"(the model ... has hidden size 64)" was added to every refusal: an empty file, token ids, offsets."""
    s = service.new_session()
    size = "(the model tiny-llama has hidden size 64)"
    with pytest.raises(ServiceError) as info:
        service.banks.upload(s, bank_file(tmp_path / "wide.pt", 32))
    assert "expected vectors of dimension 64, got dimension 32 " + size in str(info.value)
    values = MemoryVectorDB(384, value_dim=32)  # (keys of the model's key encoder, values too narrow)
    values.add(torch.randn(2, 384), ["a", "b"], values=[torch.randn(2, 32), torch.randn(1, 32)])
    values.save(tmp_path / "values.pt")
    with pytest.raises(ServiceError, match=r"expected value vectors of dimension 64, got dimension 32 "
                                           r"\(the model tiny-llama has hidden size 64\)"):
        service.banks.upload(s, tmp_path / "values.pt")

    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"embeddings": torch.randn(2, 384), "values": torch.tensor([5, 10 ** 9, 7]),
                "value_offsets": torch.tensor([0, 1, 3])}, tmp_path / "ids.pt")
    torch.save({"embeddings": torch.randn(2, 384), "values": torch.tensor([5, 6, 7]),
                "value_offsets": torch.tensor([0, 3, 3])}, tmp_path / "offsets.pt")
    cases = {"empty.pt": "got an empty file (0 bytes)", "ids.pt": "vocabulary", "offsets.pt": "strictly increasing"}
    for name, message in cases.items():
        with pytest.raises(ServiceError) as info:
            service.banks.upload(s, tmp_path / name)
        error = str(info.value)
        assert message in error and "hidden size" not in error and error.endswith("; the current bank is kept")


def test_bare_vectors_of_the_key_encoders_size_are_told_where_keys_go(tmp_path, smollm2):
    """A bare [N, 384] tensor (text keys without their values) was refused as "expected dimension 576" alone, which
    does not say that keys of that size are read from a bank's `embeddings` beside its values (at an upload and at
    the start); a bare tensor of another size is not told so."""
    torch.save(torch.randn(3, 384), tmp_path / "keys.pt")
    note = ("(the model SmolLM2-135M-Instruct + recall-smollm2 has hidden size 576; 384 is the size of its text keys, "
            "which a bank holds as a dict with `embeddings`")
    svc = Service(config(), smollm2)
    try:
        with pytest.raises(ServiceError) as info:
            svc.banks.upload(svc.new_session(), tmp_path / "keys.pt")
        assert "expected vectors of dimension 576, got dimension 384 " + note in str(info.value)
        assert str(info.value).endswith("; the current bank is kept")
        with pytest.raises(ServiceError) as info:
            svc.banks.upload(svc.new_session(), bank_file(tmp_path / "other.pt", 100))
        assert str(info.value).endswith("got dimension 100 (the model SmolLM2-135M-Instruct + recall-smollm2 has "
                                        "hidden size 576); the current bank is kept")
        torch.save({"embeddings": torch.randn(2, 100), "values": torch.tensor([5, 6, 7]),
                    "value_offsets": torch.tensor([0, 1, 3])}, tmp_path / "keys100.pt")  # (keys of a bank with values)
        with pytest.raises(ServiceError) as info:  # (it said "has hidden size 576", which is not what is wrong)
            svc.banks.upload(svc.new_session(), tmp_path / "keys100.pt")
        assert str(info.value) == ("keys100.pt: expected vectors of dimension 384, got dimension 100 (the model "
                                   "SmolLM2-135M-Instruct + recall-smollm2 reads keys of dimension 384, its text key "
                                   "encoder's); the current bank is kept")
    finally:
        svc.close()
    with pytest.raises(ServiceError) as info:  # (a service given its model loads the shared bank as it is made)
        Service(config(f"memory.bank={tmp_path / 'keys.pt'}"), smollm2).close()
    assert "keys.pt' cannot be loaded: " in str(info.value) and "got dimension 384 " + note in str(info.value)


def test_a_line_already_in_the_bank_is_not_written_again(service):
    """Writing the same line three times gave three identical memories, which then filled the search's top results."""
    s = service.new_session()
    first = result(service.banks.write(s, "The ferry leaves at seven.\nOda bakes saffron bread."))
    assert first == [0, 1] and str(first) == "2 memories [0, 1]" and first.skipped == 0
    again = result(service.banks.write(s, "The ferry leaves at seven.\nMira's boat is the Heron.\n"
                                          "Oda bakes saffron bread."))
    assert again == [2] and again.skipped == 2 and "wrote {result}".format(result=again) == \
        "wrote 1 memory [2]; 2 already in the bank"  # (the page's status)
    bank = service.banks.of(s)
    assert bank.texts() == ["The ferry leaves at seven.", "Oda bakes saffron bread.", "Mira's boat is the Heron."]
    same = result(service.banks.write(s, "  The ferry leaves at seven.  \nThe ferry leaves at seven."))
    assert same == [] and same.skipped == 2 and str(same) == "nothing; 2 already in the bank"
    twice = result(service.banks.write(s, "Bread on Tuesday.\nBread on Tuesday."))  # a line typed twice: once
    assert twice == [3] and twice.skipped == 1 and len(bank) == 4
    found = [hit["text"] for hit in service.banks.find(s, "When does the ferry leave?", 3)]
    assert found.count("The ferry leaves at seven.") == 1


def test_a_write_is_refused_whole_when_too_big_a_question_or_its_bank_was_replaced_while_it_waited(service, tmp_path):
    """Three ways a write lost memories or held everyone: an upload while a write waited made the write go to the
    bank no longer used (it said "wrote 300 memories", the bank had none of them); a paste of 6,000 lines held the
    model for 30 s, every user's chat waiting; a question was kept as a memory, and read instead of the fact."""
    import threading

    from chat.banks import MAX_WRITE
    from chat.worker import Request

    s = service.new_session()
    with pytest.raises(ServiceError, match=f"expected at most {MAX_WRITE} memories in one write .* got 501"):
        service.banks.write(s, "\n".join(f"Fact number {i}." for i in range(501)))
    with pytest.raises(ServiceError, match="lines 2, 3: expected statements .* 'Who keeps bees in Holloway\\?'"):
        service.banks.write(s, "Oda keeps bees.\nWho keeps bees in Holloway?\nWhere is it? ")
    assert service.banks.of(s) is None  # nothing written
    typed = result(service.banks.write(s, "One\u2028Two.\n\u200b\nThree\x0cFour."))  # (a line each, the blank none)
    assert service.banks.of(s).texts() == ["One\u2028Two.", "Three\x0cFour."] and len(typed) == 2

    held, go = threading.Event(), threading.Event()
    service.worker.submit(Request("hold", lambda _: held.set() or go.wait(30), None))  # (the write waits behind it)
    assert held.wait(30)
    waiting = service.banks.write(s, "The ferry leaves at seven.")
    service.banks.upload(s, bank_file(tmp_path / "up.pt", 64))
    uploaded = service.banks.of(s)
    go.set()
    with pytest.raises(ServiceError, match="bank changed while the memories waited to be written .* nothing was "
                                           "written"):
        result(waiting)
    assert service.banks.of(s) is uploaded and uploaded.texts() == ["fact 0", "fact 1", "fact 2"]
    assert result(service.banks.write(s, "The ferry leaves at seven.")) == [3]  # (written again: to the new bank)


def test_writes_skip_the_lines_of_a_shared_bank_and_stay_all_or_nothing(service, tiny_llama):
    s = service.new_session()
    result(service.banks.build_example(s))
    example = service.banks.example
    known = example.text(0)
    done = result(service.banks.write(s, f"{known}\nA new fact about the harbour."))
    assert done == [len(example)] and done.skipped == 1 and s.bank_use == "own"
    assert service.banks.label(s) == "your copy of the example bank"  # (it said "... bank (shared)", and "own")
    assert service.banks.of(s).texts().count(known) == 1 and len(example) == 36  # the shared bank is untouched
    other = service.new_session()  # every line known: nothing to copy, the session keeps the shared bank
    service.banks.use(other, "example")
    assert result(service.banks.write(other, known)).skipped == 1 and service.banks.of(other) is example
    small = Service(config("memory.max_memories_per_session=3"), tiny_llama)
    try:  # over the limit counts the new lines only; over it, nothing is written
        t = small.new_session()
        result(small.banks.write(t, "one\ntwo"))
        assert result(small.banks.write(t, "one\ntwo\nthree")) == [2]
        with pytest.raises(ServiceError, match="the bank would hold 4 memories"):
            result(small.banks.write(t, "three\nfour"))
        assert small.banks.of(t).texts() == ["one", "two", "three"]
    finally:
        small.close()


def test_written_travels_as_a_list_with_its_count():
    import pickle

    back = pickle.loads(pickle.dumps(Written([4, 5], 3)))
    assert back == [4, 5] and back.skipped == 3 and str(back) == "2 memories [4, 5]; 3 already in the bank"


def test_the_download_format_note_says_npy_is_for_vector_banks_only(service):
    """The radio said ".npy keeps no texts", but a bank of token ids (what this model writes) is refused as .npy."""
    with gr.Blocks():
        fmt = _memory_tab()["fmt"]
    assert ".npy: vector banks only" in fmt.label
    s = service.new_session()
    result(service.banks.write(s, "The ferry leaves at seven."))  # (this model writes one vector a memory)
    assert not service.banks.of(s).has_values and service.banks.save(s, ".npy").suffix == ".npy"
    tokens = MemoryVectorDB(384, token_values=True)
    tokens.add(np.ones((1, 384), np.float32), ["The ferry leaves at seven."], values=[np.array([5, 6, 7])])
    s.own_bank = tokens
    with pytest.raises(BankError, match="a .npy bank holds keys only"):
        service.banks.save(s, ".npy")
    assert service.banks.save(s, ".pt").suffix == ".pt"


def test_the_shared_bank_in_milvus_is_asked_for_the_lines_it_holds(tiny_llama, tmp_path):
    """In the store, the lines are looked up by a filter on their text (quotes, backslashes and accents kept)."""
    from milvus_lite.server_manager import server_manager_instance

    path = str(tmp_path / "bank.db")
    uri = server_manager_instance.start_and_get_uri(path)
    svc = Service(config("memory.store=milvus", f"memory.milvus_uri={uri}"), tiny_llama)
    try:
        lines = ['She said "the ferry" leaves at seven.', "A back\\slash, it's there.", "Caf\u00e9 on Friday."]
        first = result(svc.banks.write(svc.new_session(), "\n".join(lines)))
        assert len(first) == 3 and first.skipped == 0 and len(svc.banks.shared) == 3
        again = result(svc.banks.write(svc.new_session(), "\n".join([*lines, "A new line."])))
        assert len(again) == 1 and again.skipped == 3 and len(svc.banks.shared) == 4
        assert sorted(e["text"] for e in svc.banks.shared.entries(0, 10)) == sorted([*lines, "A new line."])
    finally:
        svc.close()
        server_manager_instance.release_server(path)
