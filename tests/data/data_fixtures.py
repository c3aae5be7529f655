"""Datasets shared by the tests in tests/data."""

from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    """0..length-1 as an iterable dataset with a length (batches are plain tensors)."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return iter(range(self.length))

    def __len__(self):
        return self.length
