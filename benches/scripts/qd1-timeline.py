#!/usr/bin/env python3
"""Where a QD1 read's time goes, from a syscall trace of the client and target threads.

Record a QD1 run of the load generator (its in-process target, one reactor, one worker) and
print the median of each step of the round trip:

    nvmeof-bench JOB.toml &   # one QD1 job, modes = ["tcp"], target_reactors = 1
    perf record -e raw_syscalls:sys_enter,raw_syscalls:sys_exit -p PID -o sys.data -- sleep 0.5
    perf script -i sys.data --ns -F tid,time,event,trace > sys.txt
    benches/scripts/qd1-timeline.py sys.txt

The two busiest threads are the client and the target (the target is the one that reads
72-byte command capsules). A round trip: the client's send (which, over loopback, also runs
the target's TCP receive), the target's epoll_wait that reports it, its recv, its processing
until its send (which runs the client's TCP receive), the client's epoll_wait, recv and
processing until the next send. Tracing adds a few tenths of a microsecond to each system
call, so compare traces with each other, not with untraced latencies.
"""
import statistics
import sys

RECV, SEND, EPOLL_WAIT = 45, 44, 232


def calls_by_thread(path):
    calls, entered = {}, {}
    for line in open(path):
        f = line.split()
        if len(f) < 7:
            continue
        tid, t, nr = f[0], float(f[1].rstrip(':')) * 1e6, int(f[4])
        if 'sys_enter' in f[2]:
            entered[tid] = (nr, t)
        else:
            e = entered.pop(tid, None)
            if e and e[0] == nr:
                calls.setdefault(tid, []).append((e[1], t, nr, int(f[6])))
    return calls


def main():
    calls = calls_by_thread(sys.argv[1])
    busiest = sorted(calls, key=lambda k: -len(calls[k]))[:2]
    target = next(t for t in busiest if any(c[2] == RECV and c[3] == 72 for c in calls[t][:500]))
    client = next(t for t in busiest if t != target)
    ev = sorted([(a, b, 'T', nr, r) for a, b, nr, r in calls[target]] +
                [(a, b, 'C', nr, r) for a, b, nr, r in calls[client]])

    def find(j, who, nr):
        while j < len(ev):
            if ev[j][2] == who and ev[j][3] == nr and ev[j][4] > 0:
                return j
            j += 1
        return None

    names = ['client send', 'until the target sees it', 'target: to its recv', 'target recv',
             'target: recv to send', 'target send', 'until the client sees it',
             'client: to its recv', 'client recv', 'client: recv to next send']
    steps = {n: [] for n in names}
    totals = []
    j = 0
    while True:
        idx = [find(j, 'C', SEND)]
        for who, nr in (('T', EPOLL_WAIT), ('T', RECV), ('T', SEND), ('C', EPOLL_WAIT),
                        ('C', RECV), ('C', SEND)):
            idx.append(find(idx[-1] + 1, who, nr) if idx[-1] is not None else None)
        if idx[-1] is None:
            break
        e = [ev[k] for k in idx]
        total = e[6][0] - e[0][0]
        if total < 40:  # whole round trips only, none that waited on anything else
            v = [e[0][1] - e[0][0], e[1][1] - e[0][1], e[2][0] - e[1][1], e[2][1] - e[2][0],
                 e[3][0] - e[2][1], e[3][1] - e[3][0], e[4][1] - e[3][1], e[5][0] - e[4][1],
                 e[5][1] - e[5][0], e[6][0] - e[5][1]]
            for n, x in zip(names, v):
                steps[n].append(x)
            totals.append(total)
        j = idx[-1]
    print(f'{len(totals)} round trips, median {statistics.median(totals):.2f} us (traced)')
    for n in names:
        print(f'  {n:28} {statistics.median(steps[n]):6.2f} us')


if __name__ == '__main__':
    main()
