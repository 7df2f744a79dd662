"""Index tensors from Python lists of ints, the way a step's bookkeeping needs them.

A step turns several lists of a few hundred ints (token ids, lengths, rows) into tensors.
`torch.tensor(list)` inspects every element's type and costs ~35 us for 256 ints on a CPU;
going through numpy with the dtype given costs ~6 us, and the step does this a dozen times.
"""

from __future__ import annotations

import numpy as np
import torch


def long_tensor(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor holding `values` (which must be Python ints)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
