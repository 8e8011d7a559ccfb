"""Memory bank: hidden-state vectors in FAISS, their files, and the encoder that writes them.

Knows vectors, models' hidden states and files only: nothing here imports the chat app or the UI.
"""

from memory.bank import MemoryVectorDB
from memory.encoder import HiddenStateSpec, MemoryEncoder, MemoryProjector, build_bank
from memory.files import BankData, read_bank, write_bank
from memory.validate import BankError

__all__ = ["BankData", "BankError", "HiddenStateSpec", "MemoryEncoder", "MemoryProjector", "MemoryVectorDB",
           "build_bank", "read_bank", "write_bank"]
