#!/usr/bin/env python3
"""Import circles between the top-level modules of src/ (issue 20's evidence).

    python3 scripts/import-cycles.py .    # prints the module count and every circle, or "none"

A module is a file or folder directly under src/; an edge is any `crate::X`
outside comments and unit tests. Circles are strongly connected components.
"""
import os,re,sys
root=sys.argv[1]; src=os.path.join(root,'src')
mods=set()
for f in os.listdir(src):
    if f.endswith('.rs') and f not in ('lib.rs','main.rs'): mods.add(f[:-3])
    elif os.path.isdir(os.path.join(src,f)): mods.add(f)
edges={m:set() for m in mods}
for m in mods:
    paths=[]
    p=os.path.join(src,m+'.rs')
    if os.path.exists(p): paths.append(p)
    d=os.path.join(src,m)
    if os.path.isdir(d):
        for dp,_,fs in os.walk(d):
            paths+= [os.path.join(dp,f) for f in fs if f.endswith('.rs')]
    for p in paths:
        txt='\n'.join(l for l in open(p).read().split('\n') if not l.strip().startswith('//'))
        txt=re.split(r'#\[cfg\(test\)\]\s*mod tests',txt)[0]
        for t in re.findall(r'crate::(\w+)',txt):
            if t in mods and t!=m: edges[m].add(t)
# cycles via Tarjan SCC
idx={};low={};st=[];on=set();sccs=[];i=[0]
def sc(v):
    idx[v]=low[v]=i[0];i[0]+=1;st.append(v);on.add(v)
    for w in edges[v]:
        if w not in idx: sc(w);low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        c=[]
        while True:
            w=st.pop();on.discard(w);c.append(w)
            if w==v:break
        if len(c)>1:sccs.append(c)
for v in sorted(mods):
    if v not in idx: sc(v)
print("modules:",len(mods),"cycles:",sccs or "none")
