"""A dataset whose items need a lock that a test holds in another thread of the training process
while the loader starts its workers (test_loader_workers.py): a worker forked from that process
would get the lock held, as a fork copies it, and wait for it for ever."""

import threading

import torch
from torch.utils.data import Dataset

LOCK = threading.Lock()


class NeedsTheLock(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        with LOCK:
            return torch.tensor(index)
