#!/usr/bin/env python3
"""Which module of the crate uses which, read from the source.

    tools/module_deps.py [ROOT] [--check]

Prints, for `src/` under ROOT (default: the repository), the modules each top-level
module uses, the loops among top-level modules, the files each file of a folder uses,
and the loops among the files of a folder. `--check` exits 1 on any loop, between
top-level modules or inside a folder. The crate root (lib.rs, `(root)`) re-exports
from every module and is left out of the top-level loops. Test modules and comments are
left out; a name imported through a parent's re-export counts as a use of the file
that defines it. A heuristic over the text, not the compiler's view: it reads `use`
trees, `crate::`/`super::` paths and `child::` paths.
"""
import os, re, sys, collections

args = [a for a in sys.argv[1:] if not a.startswith("--")]
check = "--check" in sys.argv[1:]
root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
def modpath(f):
    rel=os.path.relpath(f,root+'/src')[:-3].split('/')
    if rel[-1] in ('mod','lib'): rel=rel[:-1]
    return tuple(rel)
files=[]
for d,_,fs in os.walk(root+'/src'):
    for x in fs:
        if x.endswith('.rs'): files.append(os.path.join(d,x))
def strip_tests(s):
    for pat in ('#[cfg(test)]\nmod tests','#[cfg(test)]\nmod '):
        i=s.find(pat)
        if i>=0: return s[:i]
    return s
def clean(s):
    s=strip_tests(s)
    return re.sub(r'^\s*//.*$','',s,flags=re.M)
mods={modpath(f):f for f in files}
src={m:clean(open(f).read()) for m,f in mods.items()}
def expand(prefix, s):
    res=[]
    if '{' in s:
        i=s.index('{'); head=s[:i]; inner=s[i+1:s.rindex('}')]
        parts=[];depth=0;cur=''
        for ch in inner:
            if ch=='{':depth+=1
            if ch=='}':depth-=1
            if ch==',' and depth==0: parts.append(cur);cur=''
            else: cur+=ch
        if cur.strip(): parts.append(cur)
        for p in parts: res+=expand(prefix+head, p.strip())
    else:
        res.append(prefix+s)
    return res
def absolutize(m, path):
    parts=path.split(' as ')[0].split('::')
    if parts[-1]=='self': parts=parts[:-1]
    if parts[0]=='crate': return tuple(parts[1:])
    if parts[0]=='super':
        base=list(m)
        while parts and parts[0]=='super': base=base[:-1]; parts=parts[1:]
        return tuple(base)+tuple(parts)
    if parts[0]=='self': return tuple(m)+tuple(parts[1:])
    if tuple(m)+(parts[0],) in mods: return tuple(m)+tuple(parts)
    return None  # std / external
def uses(m):
    out=[]
    for mm in re.finditer(r'^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);', src[m], re.M):
        body=re.sub(r'\s+',' ',mm.group(2)).replace(' ::','::').replace(':: ','::')
        for p in expand('', body.replace(' ','').replace('as','  as  ') if False else body):
            a=absolutize(m,p.strip())
            if a is not None: out.append((a, bool(mm.group(1))))
    return out
def resolve(path, depth=0):
    # follow re-exports: if path = parent + name and parent imports name from elsewhere
    if depth>5: return path
    for k in range(len(path),-1,-1):
        if path[:k] in mods: break
    modp=path[:k]; rest=path[k:]
    if not rest: return path
    name=rest[0]
    for (u,_) in uses(modp):
        if u and u[-1]==name and u!=path:
            return resolve(u+rest[1:], depth+1)
    return path
def owner(path):
    for k in range(len(path),-1,-1):
        if path[:k] in mods: return path[:k]
    return ()
top=collections.defaultdict(set); filedeps=collections.defaultdict(set)
for m in mods:
    if m and m[-1]=='tests': continue
    refs=[]
    for (u,pub) in uses(m):
        if pub and len(u)>len(m) and u[:len(m)]==m: continue   # re-export of a child
        refs.append(u)
    for r in re.findall(r'\b((?:crate|super)(?:::[A-Za-z_][A-Za-z_0-9]*)+)', src[m]):
        a=absolutize(m,r)
        if a is not None: refs.append(a)
    # inline paths through a child module (`worker::watch_loop(..)`)
    code=re.sub(r'^\s*(pub(\([^)]*\))?\s+)?use\s[^;]*;','',src[m],flags=re.M)
    for c in set(re.findall(r'(?<![:\w])([a-z_][a-z_0-9]*)::[A-Za-z_]', code)):
        if m+(c,) in mods: refs.append(m+(c,))
    for r in refs:
        o=owner(resolve(r))
        tm=m[0] if m else '(root)'; to=o[0] if o else '(root)'
        if o==m: continue
        if to!=tm:
            top[tm].add(to)
        else:
            if m and o[:len(m)]==m and len(o)>len(m) and False: pass
            filedeps['::'.join(m)].add('::'.join(o) or '(root)')
print("# module -> modules it uses")
for k in sorted(top): print(f"{k:12} -> {', '.join(sorted(top[k]))}")
def cycles(g):
    # simple: find strongly connected components > 1
    index={};low={};st=[];on=set();res=[];i=[0]
    def sc(v):
        index[v]=low[v]=i[0];i[0]+=1;st.append(v);on.add(v)
        for w in g.get(v,()):
            if w not in index: sc(w); low[v]=min(low[v],low[w])
            elif w in on: low[v]=min(low[v],index[w])
        if low[v]==index[v]:
            comp=[]
            while True:
                w=st.pop();on.discard(w);comp.append(w)
                if w==v: break
            if len(comp)>1: res.append(sorted(comp))
    for v in list(g):
        if v not in index: sc(v)
    return res
print("\n# loops between top-level modules")
tops=cycles({k: {v for v in vs if v!='(root)'} for k, vs in top.items() if k!='(root)'})
for c in tops: print(' <-> '.join(c))
if not tops: print('none')
print("\n# inside folders: file -> files of the same folder it uses")
for k in sorted(filedeps): print(f"{k:28} -> {', '.join(sorted(filedeps[k]))}")
print("\n# loops inside folders")
cs=cycles(filedeps)
for c in cs: print(' <-> '.join(c))
if not cs: print('none')
sys.exit(1 if check and (cs or tops) else 0)
