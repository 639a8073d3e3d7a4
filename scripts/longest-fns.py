#!/usr/bin/env python3
"""The longest functions under src/, in lines (issue 20's evidence).

    python3 scripts/longest-fns.py . [N]   # N rows, default 12: lines, file, name, first line
"""
import re,sys,os
# prints the longest fn bodies (lines) under src/
root=sys.argv[1]; rows=[]
for d,_,fs in os.walk(os.path.join(root,'src')):
    for f in fs:
        if not f.endswith('.rs'): continue
        p=os.path.join(d,f); L=open(p).read().split('\n')
        i=0
        while i<len(L):
            m=re.match(r'\s*(pub(\([^)]*\))?\s+)?(async\s+)?fn\s+(\w+)',L[i])
            if m and not L[i].strip().startswith('//'):
                depth=0; started=False; j=i
                while j<len(L):
                    depth+=L[j].count('{')-L[j].count('}')
                    if '{' in L[j]: started=True
                    if started and depth<=0: break
                    if not started and L[j].rstrip().endswith(';'): break
                    j+=1
                rows.append((j-i+1,os.path.relpath(p,root),m.group(4),i+1)); i+=1
            else: i+=1
rows.sort(reverse=True)
for r in rows[:int(sys.argv[2]) if len(sys.argv)>2 else 12]: print(*r)
