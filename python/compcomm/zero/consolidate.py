"""``python -m compcomm.zero.consolidate <dir> <out.pt>``: full fp32 state dict from ZeRO shards."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch

from .checkpoint import consolidate


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m compcomm.zero.consolidate", description=__doc__)
    ap.add_argument("directory", help="directory holding zero_rank<r>_of<W>.pt files")
    ap.add_argument("output", help="where to write the fp32 state dict (torch.save)")
    ap.add_argument("--world-size", type=int, default=None,
                    help="which run's shards, when the directory holds runs of several world sizes")
    args = ap.parse_args(argv)
    sd = consolidate(args.directory, args.world_size)
    torch.save(sd, args.output)
    n = sum(t.numel() for t in sd.values())
    print(f"wrote {len(sd)} tensors ({n} fp32 elements) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
