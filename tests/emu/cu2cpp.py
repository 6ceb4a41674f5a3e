#!/usr/bin/env python3
"""tests/emu/cu2cpp.py IN.cu OUT.cpp - the emulator's one preprocessing step.

Rewrites each kernel launch `kernel<T...><<<grid, block[, shared[, stream]]>>>(args)` into
`::mgpu_emu::launch("kernel<T...>", file, line, ::mgpu_emu::cfg(grid, block, ...), ENTRY,
[](const auto&... a_) { kernel<T...>(a_...); }, args)`, and each declaration of dynamic shared
memory, `extern __shared__ T name[];`, into `T* const name = static_cast<T*>(::mgpu_emu::dynamic_shared());`;
nothing else. ENTRY, the key of cudaFuncSetAttribute's limits, is `::mgpu_emu::entry(&kernel<T...>)`
for a launch with dynamic shared memory (a third argument other than 0), so such a kernel's
template arguments are all spelled out; nullptr for the others. Line numbers are kept (a `#line` first, and
every launch rewritten within its own lines), so compiler messages and the emulator's reports
name the .cu file and its lines."""
import re
import sys

SHARED = re.compile(r'\bextern\s+__shared__\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*\[\s*\]\s*;')
LAUNCH = re.compile(r'\b([A-Za-z_]\w*(?:<[^<>;{}()]*>)?)\s*<<<(.*?)>>>\s*\((\s*\))?', re.S)


def top_level_args(text):
    """text's comma-separated parts, the commas inside brackets not counted"""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == ',' and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def rewrite(m):
    kernel, config, empty = m.group(1), m.group(2), m.group(3)
    newlines = m.group(0).count('\n')
    args = top_level_args(config)
    entry = '::mgpu_emu::entry(&%s)' % kernel if len(args) > 2 and args[2] != '0' else 'nullptr'
    out = ('::mgpu_emu::launch("%s", __FILE__, __LINE__, ::mgpu_emu::cfg(%s), %s, '
           '[](const auto&... a_) { %s(a_...); }' % (kernel, ' '.join(config.split()), entry, kernel))
    out += ')' if empty is not None else ', '
    return out + '\n' * newlines


def main():
    src_path, out_path = sys.argv[1], sys.argv[2]
    with open(src_path) as f:
        text = f.read()
    text = SHARED.sub(r'\1* const \2 = static_cast<\1*>(::mgpu_emu::dynamic_shared());', text)
    body, count = LAUNCH.subn(rewrite, text)
    if count == 0 or '<<<' in body or re.search(r'\bextern\s+__shared__', body):
        sys.exit('cu2cpp: %s: %s' % (src_path, 'no launch found' if count == 0 else
                                     'a launch was not rewritten' if '<<<' in body else
                                     'an extern __shared__ declaration was not rewritten (want `extern __shared__ T name[];`)'))
    with open(out_path, 'w') as f:
        f.write('#line 1 "%s"\n' % src_path)
        f.write(body)


if __name__ == '__main__':
    main()
