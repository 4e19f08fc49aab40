"""Cases of ``deepep_lightning::index_put_accumulate_``, shared by its CPU and GPU tests."""

import torch


def index_put_cases(device: str = "cpu", dtype: torch.dtype = torch.float64):
    """(self, indices, values) cases of index_put_(accumulate=True): what the MoE, bias-table and gather backwards
    send, and the edges of the op (negative and int32 indices, broadcasting, three index tensors, no entries)."""
    generator = torch.Generator().manual_seed(5)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).to(device, dtype)

    def rows(high, count, low=0):
        return torch.randint(low, high, (count,), generator=generator).to(device)

    yield "gather backward, repeated rows", draw(64, 24), [rows(64, 200)], draw(200, 24)
    yield "two indices, scalar rows", draw(64, 2), [rows(64, 30), rows(2, 30)], draw(30)
    yield "negative and int32", draw(9, 4), [rows(9, 40, low=-9).int()], draw(40, 4)
    yield "broadcast indices and values", draw(5, 4, 3), [rows(5, 6), rows(4, 1)], draw(3)
    yield "three indices", draw(4, 3, 5, 2), [rows(4, 7), rows(3, 7), rows(5, 7)], draw(7, 2)
    yield "no entries", draw(6, 3), [rows(6, 0)], draw(0, 3)
