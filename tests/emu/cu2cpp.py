#!/usr/bin/env python3
"""tests/emu/cu2cpp.py IN.cu OUT.cpp - the emulator's one preprocessing step.

Rewrites each kernel launch `kernel<T...><<<grid, block[, shared[, stream]]>>>(args)` into
`::mgpu_emu::launch("kernel<T...>", file, line, ::mgpu_emu::cfg(grid, block, ...), [](const auto&... a_)
{ kernel<T...>(a_...); }, args)`, and nothing else. Line numbers are kept (a `#line` first, and
every launch rewritten within its own lines), so compiler messages and the emulator's reports
name the .cu file and its lines."""
import re
import sys

LAUNCH = re.compile(r'\b([A-Za-z_]\w*(?:<[^<>;{}()]*>)?)\s*<<<(.*?)>>>\s*\((\s*\))?', re.S)


def rewrite(m):
    kernel, config, empty = m.group(1), m.group(2), m.group(3)
    newlines = m.group(0).count('\n')
    out = ('::mgpu_emu::launch("%s", __FILE__, __LINE__, ::mgpu_emu::cfg(%s), '
           '[](const auto&... a_) { %s(a_...); }' % (kernel, ' '.join(config.split()), kernel))
    out += ')' if empty is not None else ', '
    return out + '\n' * newlines


def main():
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path) as f:
        text = f.read()
    body, count = LAUNCH.subn(rewrite, text)
    if count == 0 or '<<<' in body:
        sys.exit('cu2cpp: %s: %s' % (src_path, 'no launch found' if count == 0 else 'a launch was not rewritten'))
    with open(out_path, 'w') as f:
        f.write('#line 1 "%s"\n' % src_path)
        f.write(body)


if __name__ == '__main__':
    main()
