#!/usr/bin/env python3
# Usage: python3 scripts/fn-lengths.py <root> [N] -- the N longest functions outside tests (issue 24 measure).
"""Length of every fn (signature line to its closing brace at the same indent), outside tests:
skips the tests/ crate, vendor/, target/, and everything after `#[cfg(test)]` in a file."""
import os, re, sys
root = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
fn_re = re.compile(r'^(\s*)(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)')
out = []
for dp, dn, fnames in os.walk(root):
    dn[:] = [d for d in dn if d not in ('target', 'vendor', '.git') and not (dp == root and d == 'tests')]
    for f in fnames:
        if not f.endswith('.rs'): continue
        p = os.path.join(dp, f)
        lines = open(p, encoding='utf-8').read().split('\n')
        for i, l in enumerate(lines):
            if l.strip() == '#[cfg(test)]':
                lines = lines[:i]; break
        for i, l in enumerate(lines):
            m = fn_re.match(l)
            if not m: continue
            ind = m.group(1)
            for j in range(i, len(lines)):
                if lines[j] == ind + '}' or (j == i and l.rstrip().endswith('}')) or (lines[j].startswith(ind) and lines[j].rstrip().endswith(';') and j == i):
                    break
            else:
                continue
            out.append((j - i + 1, os.path.relpath(p, root), i + 1, m.group(7)))
out.sort(reverse=True)
for o in out[:n]: print('%4d  %s:%d  %s' % o)
print('over 100:', sum(1 for o in out if o[0] > 100))
