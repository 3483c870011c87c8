"""What a weight source hands the runtime for one unit: its tensors by name (the unit's typed views, cast to the
compute dtype). Defined by the store, which produces them; runtime/weights.py re-exports it with the seam."""
from __future__ import annotations

from typing import Mapping

import torch

Weights = Mapping[str, torch.Tensor]
