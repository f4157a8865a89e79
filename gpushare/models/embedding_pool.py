"""One vector from an input's last hidden states, the way its Pooling (models/pooling.py) says."""

import torch

from gpushare.catalog.pooling import Pooling


def pool(rows: torch.Tensor, pooling: Pooling) -> list[float]:
    """``rows`` [L, H]: one input's hidden states, its special tokens included (as sentence-transformers
    pools them)."""
    rows = rows.float()
    if pooling.mode == "cls":
        vector = rows[0]
    elif pooling.mode == "last":
        vector = rows[-1]
    else:
        vector = rows.mean(dim=0)
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
