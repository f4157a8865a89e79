"""One vector from an input's last hidden states, the way its Pooling (models/pooling.py) says, cut to a
request's Matryoshka ``dimensions``."""

import torch

from gpushare.catalog.pooling import Pooling


def pool(rows: torch.Tensor, pooling: Pooling, dimensions: int | None = None) -> torch.Tensor:
    """``rows`` [L, H]: one input's hidden states, its special tokens included (as sentence-transformers
    pools them); a float32 vector [H], or its first ``dimensions`` values L2-normalised again."""
    rows = rows.float()
    if pooling.mode == "cls":
        vector = rows[0]
    elif pooling.mode == "last":
        vector = rows[-1]
    else:
        vector = rows.mean(dim=0)
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    if dimensions:
        vector = torch.nn.functional.normalize(vector[:dimensions], dim=0)
    return vector
