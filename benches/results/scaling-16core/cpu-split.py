#!/usr/bin/env python3
"""Machine-wide CPU split per measurement: CPUs 0-7 (target) and 8-15 (client), from the 1 s
/proc/stat samples run.sh takes (procstat.txt, kept here gzipped) and the time each measurement ended (the
timestamped *.err lines). Window: the samples within the 5 s before a measurement ended.
Columns are cores busy (user, system, softirq, steal); run in the directory run.sh wrote.
Output of the second run: cpu-split.txt."""
import re,sys,glob
# parse procstat samples
samples=[]
cur=None
import gzip, os
for line in (gzip.open('procstat.txt.gz', 'rt') if os.path.exists('procstat.txt.gz') else open('procstat.txt')):
    if line.startswith('T '):
        cur={'t':float(line.split()[1])}; samples.append(cur)
    elif line.startswith('cpu'):
        f=line.split(); cur[f[0]]=list(map(int,f[1:]))
def util(a,b,cpus):
    # fields: user nice system idle iowait irq softirq steal guest guestnice
    tot=[0]*10
    for c in cpus:
        for i in range(10): tot[i]+=b[c][i]-a[c][i]
    s=sum(tot[:8]); 
    if s==0: return None
    busy=s-tot[3]-tot[4]
    return dict(busy=busy/s*len(cpus), usr=tot[0]/s*len(cpus), sys=tot[2]/s*len(cpus), sirq=tot[6]/s*len(cpus), steal=tot[7]/s*len(cpus))
T=['cpu%d'%i for i in range(8)]; C=['cpu%d'%i for i in range(8,16)]
for name in ['r1','r2','r4','r8','poll100','r8-noverify']:
    for line in open(name+'.err'):
        m=re.match(r'(\S+) \[(\S+)\] (.*?): ',line)
        if not m: continue
        t=float(m.group(1)); lo=t-5.0; 
        win=[s for s in samples if lo+0.05<=s['t']<=t-0.05]
        if len(win)<2: print(name,'short'); continue
        a,b=win[0],win[-1]
        ut=util(a,b,T); uc=util(a,b,C)
        print(f"{name:12s} {m.group(2):8s} {m.group(3):26s} win={b['t']-a['t']:.1f}s  T0-7 busy {ut['busy']:.2f} (usr {ut['usr']:.2f} sys {ut['sys']:.2f} sirq {ut['sirq']:.2f} steal {ut['steal']:.2f}) | C8-15 busy {uc['busy']:.2f} (usr {uc['usr']:.2f} sys {uc['sys']:.2f} sirq {uc['sirq']:.2f} steal {uc['steal']:.2f})")
