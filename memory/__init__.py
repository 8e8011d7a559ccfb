"""Memory bank: hidden-state vectors in FAISS, their files, their checks and the approximate index.

Knows vectors and files only: nothing here imports a model, the chat app or the UI (the encoder
that writes the vectors is the model's: `models/encoder.py`).
"""

from memory.bank import MemoryVectorDB
from memory.files import BankData, read_bank, write_bank
from memory.validate import BankCheck, BankError, DimensionError

__all__ = ["BankCheck", "BankData", "BankError", "DimensionError", "MemoryVectorDB", "read_bank", "write_bank"]
