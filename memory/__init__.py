"""Memory bank: hidden-state vectors in FAISS, their files, and writing them from texts.

Knows vectors and files only: nothing here imports the chat app or the UI.
"""

from memory.bank import MemoryVectorDB
from memory.files import BankData, read_bank, write_bank
from memory.validate import BankError
from memory.writer import HiddenStateSpec, build_bank, encode_inputs, encode_texts

__all__ = [
    "BankData", "BankError", "HiddenStateSpec", "MemoryVectorDB",
    "build_bank", "encode_inputs", "encode_texts", "read_bank", "write_bank",
]
