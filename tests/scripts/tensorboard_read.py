"""Reads a directory of TensorBoard event files with TensorBoard's own loader.

Usage: tensorboard_read.py LOGDIR

Prints one JSON object: the file version TensorBoard saw, and each scalar tag's points as
[step, value] pairs, after TensorBoard's handling of restarts (a session start in a later
file drops the earlier files' steps from that one on). Used by
tests/tests/integration/tensorboard.rs.
"""

import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def main():
    acc = event_accumulator.EventAccumulator(
        sys.argv[1], size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    scalars = {
        tag: [[e.step, e.value] for e in acc.Scalars(tag)]
        for tag in acc.Tags()[event_accumulator.SCALARS]
    }
    print(json.dumps({"file_version": acc.file_version, "scalars": scalars}))


if __name__ == "__main__":
    main()
