"""A guard on the preprocessing core's speed: mmserve against transformers' processors, in
one run, single thread, process CPU time (so that other load on a shared machine inflates
both sides alike), median of `--runs` calls each after an untimed one (`bench.preprocess`'s
`time_paths`). Exits 1 when any ratio (the processor's time over mmserve's) is below the one
stated in `RATIOS`. Run it (`make bench-check`) before every stop that touches the Rust core;
it is a check of this machine, not a timing test in CI.

    .venv/bin/python -m bench.preprocess_check
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Single thread for every path; set before torch and mmserve read them.
SINGLE_THREAD = {"MMSERVE_MM_THREADS": "1", "OMP_NUM_THREADS": "1"}

# (width, height, format, processor path, mmserve path) -> the least processor/mmserve ratio.
RATIOS: dict[tuple[int, int, str, str, str], float] = {
    (3840, 2160, "JPEG", "hf-torchvision", "mmserve[torch]"): 2.5,
    (1280, 960, "JPEG", "hf-torchvision", "mmserve[torch]"): 1.5,
    (1280, 960, "JPEG", "hf-pil", "mmserve[pil]"): 3.0,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="timed calls per path and image")
    args = parser.parse_args()
    os.environ.update(SINGLE_THREAD)
    import torch

    from bench.preprocess import encode, make_paths, photo, time_paths

    torch.set_num_threads(1)
    single, _, _ = make_paths("")
    load = os.getloadavg()[0]
    print(f"# preprocess check: single thread, median CPU ms of {args.runs} (load {load:.1f})")
    failures = []
    for (w, h, fmt, anchor, ours), least in RATIOS.items():
        data = encode(photo(w, h, w + h), fmt)
        calls = {name: single[name] for name in (anchor, ours)}
        timed = time_paths(calls, data, args.runs, time.process_time)
        (anchor_ms, _), (ours_ms, faults) = timed[anchor], timed[ours]
        ratio = anchor_ms / ours_ms
        line = (
            f"{w}x{h} {fmt}: {anchor} {anchor_ms:.1f} ms, {ours} {ours_ms:.1f} ms "
            f"({faults:.0f} faults/call): {ratio:.2f}x, at least {least}x"
        )
        print(line)
        if ratio < least:
            failures.append(line)
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    return int(bool(failures))


if __name__ == "__main__":
    sys.exit(main())
