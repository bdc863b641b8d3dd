#!/usr/bin/env python3
"""Checks `check.py`'s host-synchronisation guard (`refuse_host_sync`), the one the
CUDA-graph decode peer's step runs under: indexing with a 0-dim device tensor (`wpe[pos]`),
`.item()`, `nonzero` and a tensor's truth value are refused, each naming its op, and the
step's own ops (`index_select`, `index_copy_`, `argmax`, a mask from a comparison) pass.

    python3 tests/gpu/host_sync_test.py

Prints one JSON line; `{"skipped": ...}` where PyTorch is not installed. Exits 1 on a
failure.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check import HostSync, refuse_host_sync, torch_or_none  # noqa: E402


def refused(torch, what):
    """The op that `what` was refused for under the guard, or None where it ran."""
    try:
        with refuse_host_sync(torch):
            what()
    except HostSync as e:
        return str(e)
    return None


def main():
    torch = torch_or_none()
    if torch is None:
        print(json.dumps({"skipped": "no torch"}))
        return 0
    wpe = torch.randn(8, 4)
    pos = torch.tensor(3)
    cache = torch.zeros(2, 8, 4)
    syncs = {
        "wpe[pos]": lambda: wpe[pos],
        "pos.item()": lambda: pos.item(),
        "nonzero": lambda: torch.nonzero(wpe > 0),
        "bool(tensor)": lambda: bool(pos > 2),
    }
    allowed = {
        "index_select": lambda: wpe.index_select(0, pos.view(1)),
        "index_copy_": lambda: cache.index_copy_(1, pos.view(1), torch.ones(2, 1, 4)),
        "argmax": lambda: torch.argmax(wpe, dim=-1),
        "mask": lambda: (torch.arange(8) <= pos).view(1, 8),
    }
    out = {"refused": {k: refused(torch, f) for k, f in syncs.items()},
           "allowed": {k: refused(torch, f) for k, f in allowed.items()}}
    ok = all(out["refused"].values()) and not any(out["allowed"].values())
    out["passed"] = ok
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
