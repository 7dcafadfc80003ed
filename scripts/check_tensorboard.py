#!/usr/bin/env python3
"""Reads a replica run directory with TensorBoard's own event reader and prints its scalars.

  pip install tensorboard && python3 scripts/check_tensorboard.py runs/default

Exits non-zero if TensorBoard finds no scalars (the file would be unreadable to it).
"""
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/default"
acc = EventAccumulator(run_dir)
acc.Reload()
tags = acc.Tags()["scalars"]
if not tags:
    sys.exit(f"{run_dir}: TensorBoard found no scalars")
for tag in sorted(tags):
    events = acc.Scalars(tag)
    print(f"{tag:28s} {len(events):5d} points, step {events[0].step}..{events[-1].step}, last {events[-1].value:.4g}")
