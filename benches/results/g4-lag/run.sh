#!/bin/bash
# Run from the repository root on the GPU machine, with flush.c built beside delay.py
# (gcc -O2 -shared -fPIC -o libflush.so flush.c) and tcp-ceiling.py at hand.
# HOW:LAG pairs: HOW none, demote (CLDEMOTE), flushopt (CLFLUSHOPT), wb (CLWB) over each MiB
# right after it was received; LAG the messages received before a message is copied.
d=benches/results/g4-lag
for r in 1 2; do
  python3 $d/delay.py none:0,demote:0,flushopt:0,wb:0,none:2
  python3 $d/delay.py none:2,wb:0,flushopt:0,demote:0,none:0
done
