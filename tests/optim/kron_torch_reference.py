"""Runs pytorch-optimizer's ``Kron`` on the inputs in an .npz file and writes its parameters after each step.

Usage: ``python kron_torch_reference.py inputs.npz outputs.npz`` under a Python with torch and
pytorch_optimizer (tests/optim/test_psgd_kron.py writes the inputs and compares). ``torch.randn_like``
is replaced by the noise the inputs give for each step, so the run is deterministic; the reference's
random rebalancing is off (``balance_prob=0``).
"""

import json
import sys

import numpy as np
import torch
from pytorch_optimizer import Kron


def main(inputs: str, outputs: str) -> None:
    data = np.load(inputs)
    config = json.loads(str(data["config"]))
    names, steps = config.pop("names"), config.pop("steps")
    params = [torch.nn.Parameter(torch.tensor(data[f"param/{n}"])) for n in names]
    opt = Kron(params, balance_prob=0.0, **config)
    queue: list[np.ndarray] = []

    def randn_like(x, dtype=None, **_):
        return torch.tensor(queue.pop(0), dtype=dtype or x.dtype)

    torch.randn_like = randn_like
    out = {}
    for t in range(steps):
        queue[:] = [data[f"noise/{t}/{n}"] for n in names]
        for p, n in zip(params, names, strict=True):
            p.grad = torch.tensor(data[f"grad/{t}/{n}"])
        opt.step()
        for p, n in zip(params, names, strict=True):
            out[f"{t}/{n}"] = p.detach().numpy().copy()
    np.savez(outputs, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
