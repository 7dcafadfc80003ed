#!/usr/bin/env python3
"""Per-kernel SASS comparison of two sets of CUDA objects (a mechanical move of kernels between
files must leave every kernel's machine code as it was).

  scripts/sass-diff.py BEFORE.o[,MORE.o...] AFTER.o[,MORE.o...]

Kernels are keyed by (architecture, demangled name) with the anonymous namespace's per-file tag
removed; each kernel's SASS is compared with addresses and encodings dropped. Needs cuobjdump and
nvdisasm on PATH (the CUDA toolkit; PyPI's nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels).
Exit 0 when both sides have the same kernels with the same instructions."""
import re
import subprocess
import sys

ANON = re.compile(r'_GLOBAL__N__[0-9a-zA-Z_]+')


def kernels(objs):
    out = {}
    for o in objs:
        txt = subprocess.run(['cuobjdump', '-sass', o], capture_output=True, text=True, check=True).stdout
        arch, key, body = None, None, []
        for line in txt.split('\n'):
            m = re.match(r'\s*arch = (sm_\d+)', line)
            if m:
                arch = m.group(1)
            if line.startswith('Fatbin') or re.match(r'\s*\.{6,}', line):
                if key:
                    out[key] = body
                key, body = None, []
                continue
            m = re.match(r'\s*Function : (\S+)', line)
            if m:
                if key:
                    out[key] = body
                dem = subprocess.run(['c++filt', m.group(1)], capture_output=True, text=True).stdout.strip()
                key, body = (arch, ANON.sub('(file)', dem)), []
                continue
            if key:
                s = re.sub(r'/\*[0-9a-f]{4}\*/', '', line)
                s = ANON.sub('(file)', re.sub(r'/\* 0x[0-9a-f]+ \*/', '', s)).strip()
                if s:
                    body.append(s)
        if key:
            out[key] = body
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    before, after = kernels(sys.argv[1].split(',')), kernels(sys.argv[2].split(','))
    only_b, only_a = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    diff = sorted(k for k in before if k in after and before[k] != after[k])
    same = sum(1 for k in before if k in after and before[k] == after[k])
    archs = sorted({k[0] for k in before})
    print(f'kernels: {len(before)} before, {len(after)} after ({", ".join(archs)}); '
          f'identical SASS: {same}; differing: {len(diff)}; only before: {len(only_b)}; only after: {len(only_a)}')
    for k in only_b:
        print('  only before:', k)
    for k in only_a:
        print('  only after: ', k)
    for k in diff:
        print('  differs:    ', k)
    sys.exit(0 if not (diff or only_a or only_b) else 1)


if __name__ == '__main__':
    main()
