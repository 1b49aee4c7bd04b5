"""Test-wide settings.

The models in the tests are tiny: one torch thread avoids thread hand-off
costs that dominate their matmuls on CI's two cores.
"""

import torch

torch.set_num_threads(1)
