#!/usr/bin/env python3
"""Summarises tools/gpu-ab.sh's ab.log: per bench case, each variant's mean rate over its rounds
and its change against "old" (the same call's baseline), or against the variant named by
--base NAME.  python3 tools/ab-table.py OUT_DIR/ab.log [--base NAME]"""
import sys, re, collections
data = collections.defaultdict(lambda: collections.defaultdict(list))
order = []; names = []
cur = None
args = sys.argv[1:]
base = 'old'
if '--base' in args:
    at = args.index('--base')
    if at + 1 >= len(args): sys.exit('ab-table: --base needs a variant name')
    base = args[at + 1]
    del args[at:at + 2]
for line in open(args[0]):
    m = re.match(r'=== \[(\S+)\] bench round (\d+)', line)
    if m:
        cur = m.group(1)
        if cur not in order: order.append(cur)
        continue
    if line.startswith('==='): cur = None; continue
    # "%-44s %10.3f %7.2f...": the name, milliseconds, the rate (a name may be longer than 44).
    m = re.match(r'(\S.*?)\s+(\d+\.\d+)\s+(\d+\.\d+)', line)
    if cur and m:
        name, rate = m.group(1), float(m.group(3))
        if name not in names: names.append(name)
        data[cur][name].append(rate)
vs = [v for v in order if v != base] + [base]
print('%-44s' % 'case' + ''.join('%16s' % v for v in vs))
for n in names:
    old = data[base][n]; o = sum(old)/len(old) if old else 0
    row = '%-44s' % n
    for v in vs:
        r = data[v][n]
        if not r: row += '%16s' % '-'; continue
        a = sum(r)/len(r)
        row += '%9.1f' % a + ('(%+5.1f)' % (100*(a/o-1)) if o and v != base else '       ')
    print(row)
