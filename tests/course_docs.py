#!/usr/bin/env python3
"""The course's text (docs/course/en and docs/course/zh), checked two ways; tests/course.sh runs both.

  course_docs.py commands TMP [DATA [FILE...]]
      Runs every shell command the course README and the lessons show (```sh blocks of the English
      files; the Chinese ones must show the same commands), AS WRITTEN, each file in a fresh copy
      of the repository (its tracked and unignored files: no build/ folder), then checks every
      quoted output (```text blocks) against what the commands printed. Markers, HTML comments
      just above a block (invisible on the page), say what a block is:
        <!-- course-not-run: WHY -->        above ```sh: not run here (a real GPU, torchrun, sudo ...)
        <!-- course-output: CMD -->         above ```text: the output of CMD, one of the file's
                                            commands (the whole line, or its part after '&&');
                                            several such lines: their outputs together
        <!-- course-varies: TEXT -->        the quoted lines containing TEXT are not compared
                                            (timings, rates)
        <!-- course-varies-last: TEXT -->   the quoted lines containing TEXT are compared but for
                                            their last field (a count of waits, which hangs on timing)
        <!-- course-numbers-within: TOL -->  the quoted lines may differ from the printed ones in
                                            their numbers, each by at most TOL (PyTorch's sums
                                            round as the CPU's BLAS kernels do: other last digits
                                            on another CPU)
        <!-- course-illustrative: WHY -->   above ```text: not an output to check (a formula, or
                                            an output of a machine this test does not have)
        <!-- course-table-column: N: CMD -->  above a markdown table (en and zh): every cell of
                                            its column N, below the header, is a number CMD printed
        <!-- course-table-column: N within TOL: CMD -->  the same, within TOL of a number it printed
      Every ```text block must carry course-output or course-illustrative. A quoted line must be
      a whole line of the output; "..." in it stands for any text (a line shown shortened).
      Between files only the emulator's libraries are kept (build/emu/mgpu_kernels.*,
      libmgpuemu.so, libnccl_emu.so: what the first `make emu-program` built), so that each
      lesson is run as a reader who starts there would run it. Once they are built, COURSE_JOBS
      files run at a time (default: one per core), each in its own copy; the lines of each are
      shown together, in the files' order.
      The environment is that of a CPU-only reader: NVCC empty (make builds the CPU variants),
      a python3 with torch first in PATH where one exists, Open MPI allowed to oversubscribe
      (the lesson says to when processes outnumber cores) and to run as root. FILE...: only
      those (e.g. 07-pipelines.md), to try one lesson again.

  course_docs.py zh
      The Chinese files: one term per concept (the glossary's "术语规范" table lists each term
      and the variants no Chinese file may use outside code), full-width punctuation beside
      Chinese characters, “” quotes, lesson headings "# 第 NN 课：", no italics on Chinese words,
      no English prose (four or more English words in a row) outside code.

Each prints "  ok", "  FAIL" and "  skip" lines and ends with "N passed, N failed, N skipped".
"""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import threading
import time

EN, ZH = "docs/course/en", "docs/course/zh"
ORDER = ["README.md", "01-devices.md", "02-tensors.md", "03-memory.md", "04-simplenet.md",
         "05-data-parallel.md", "06-processes.md", "07-pipelines.md", "08-allreduce.md",
         "09-your-kernel.md", "10-gpt.md", "11-autograd.md", "glossary.md", "table.md"]
counts = [0, 0, 0]
lock = threading.Lock()
sink = threading.local()   # sink.lines: where a lesson run beside others keeps its lines


def emit(line):
    if getattr(sink, "lines", None) is not None:
        sink.lines.append(line)
    else:
        print(line, flush=True)


def buffered(fn, *args):
    """fn(*args) with its lines kept, not printed: they are returned."""
    sink.lines = []
    try:
        fn(*args)
    finally:
        lines, sink.lines = sink.lines, None
    return lines


def count(k):
    with lock:
        counts[k] += 1


def ok(msg):
    count(0)
    emit("  ok   " + msg)


def fail(msg, detail=""):
    count(1)
    emit("  FAIL " + msg)
    for line in detail.splitlines()[-12:]:
        emit("       " + line)


def skip(msg):
    count(2)
    emit("  skip " + msg)


def done():
    print("%d passed, %d failed, %d skipped" % tuple(counts))
    sys.exit(1 if counts[1] else 0)


def blocks(path):
    """The fenced blocks of a markdown file: dicts of kind, lines, markers (name -> [values]), line."""
    out, lines = [], open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            kind, start = lines[i][3:].strip(), i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            markers, k = {}, start - 1
            while k >= 0 and (lines[k].strip() == "" or lines[k].startswith("<!-- course-")):
                m = re.match(r"<!-- (course-[a-z-]+): (.*) -->$", lines[k])
                if m:
                    markers.setdefault(m.group(1), []).insert(0, m.group(2))
                k -= 1
            out.append({"kind": kind, "lines": lines[start + 1:j], "markers": markers, "line": start + 1})
            i = j + 1
        else:
            i += 1
    return out


def commands(block):
    """A sh block's commands: continuation lines joined, comments and blank lines dropped."""
    cmds, cur = [], ""
    for line in block["lines"]:
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        cmd = re.sub(r"(^|\s)#.*$", "", cur).strip()
        cur = ""
        if cmd:
            cmds.append(" ".join(cmd.split()))
    return cmds


def norm(cmd):
    return " ".join(cmd.split())


def find_cmd(cmds, want):
    """The index of the command CMD names: the whole line, or its last part after '&&'."""
    want = norm(want)
    for i, c in enumerate(cmds):
        if c == want or c.endswith("&& " + want):
            return i
    return -1


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers_close(want, got, tol):
    """The same line but for its numbers, each within tol of the one printed in its place."""
    if NUMBER.sub("#", want) != NUMBER.sub("#", got):
        return False
    return all(abs(float(a) - float(b)) <= tol for a, b in zip(NUMBER.findall(want), NUMBER.findall(got)))


def line_matches(want, outlines, tol=None):
    want = want.rstrip()
    if tol is not None:
        return any(numbers_close(want, o, tol) for o in outlines)
    if "..." not in want:
        return want in outlines
    parts = [p.strip() for p in want.split("...")]
    for o in outlines:
        pos, good = 0, True
        for p in parts:
            k = o.find(p, pos)
            if k < 0:
                good = False
                break
            pos = k + len(p)
        if good:
            return True
    return False


# ---- commands ----------------------------------------------------------------------------------

def have(cmd):
    return shutil.which(cmd) is not None


def torch_python(need_safetensors):
    for p in [os.environ.get("PYTHON", ""), "python3", "/usr/bin/python3"]:
        if not p or not (shutil.which(p) or os.path.exists(p)):
            continue
        mods = "torch, numpy" + (", safetensors" if need_safetensors else "")
        if subprocess.run([p, "-c", "import " + mods], capture_output=True).returncode == 0:
            return shutil.which(p) or p
    return None


def tracked_files():
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True)
    if r.returncode != 0:
        return None
    return [f for f in r.stdout.decode().split("\0") if f and os.path.isfile(f)]


def fresh_copy(files, dest):
    for f in files:
        d = os.path.join(dest, f)
        os.makedirs(os.path.dirname(d) or ".", exist_ok=True)
        shutil.copy2(f, d)   # keeps the times: make sees the sources as they are here


KEEP = ["build/emu/mgpu_kernels.cpp", "build/emu/mgpu_kernels.o", "build/emu/libmgpuemu.so",
        "build/emu/libnccl_emu.so"]


def run_commands(tmp, data, only):
    files = tracked_files()
    if files is None:
        skip("the lessons' commands: not a git checkout, no list of tracked files to copy")
        return
    have_data = os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz") or \
        os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte")
    py = torch_python(False)
    py_st = torch_python(True)
    have_mpi = have("mpicc") and have("mpirun")
    env = dict(os.environ)
    for k in ["MAKEFLAGS", "MFLAGS", "MAKELEVEL"]:
        env.pop(k, None)
    env["NVCC"] = ""
    env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    if os.getuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    bindir = os.path.join(tmp, "bin")
    os.makedirs(bindir, exist_ok=True)
    if py:
        os.symlink(py, os.path.join(bindir, "python3"))
        env["PATH"] = bindir + os.pathsep + env["PATH"]
    kept = os.path.join(tmp, "kept")
    os.makedirs(kept, exist_ok=True)
    data_prog = re.compile(r"(^|[\s/])(04_simplenet|04_ex[0-9]|train|train_mpi|course_simplenet\.sh)(\s|$)")

    def lesson(name):
        en = os.path.join(EN, name)
        if not os.path.exists(en) or (only and name not in only):
            return
        bl = blocks(en)
        if not any(b["kind"] == "sh" for b in bl):
            return
        clone = os.path.join(tmp, "clone-" + os.path.splitext(name)[0])
        shutil.rmtree(clone, ignore_errors=True)
        os.makedirs(clone)
        fresh_copy(files, clone)
        with lock:   # (another lesson may be keeping them now)
            for k in KEEP:
                if os.path.exists(os.path.join(kept, k)):
                    os.makedirs(os.path.dirname(os.path.join(clone, k)), exist_ok=True)
                    shutil.copy2(os.path.join(kept, k), os.path.join(clone, k))
        if os.path.exists(os.path.join(clone, "build")) and not any(os.path.exists(os.path.join(kept, k)) for k in KEEP):
            fail("%s: the fresh copy has a build/ folder" % name)
        allcmds, outputs = [], {}
        t0 = time.time()
        nrun = 0
        for b in bl:
            if b["kind"] != "sh":
                continue
            cmds = commands(b)
            first = len(allcmds)
            allcmds += cmds
            if "course-not-run" in b["markers"]:
                skip("%s line %d: %d command(s) not run here: %s" % (name, b["line"], len(cmds), b["markers"]["course-not-run"][0]))
                continue
            for n, c in enumerate(cmds):
                idx = first + n
                why = ""
                if data_prog.search(c.replace("&&", " ")) and not have_data and "mpicc" not in c and not c.startswith("cc "):
                    why = "no Fashion-MNIST in /usr/share/datasets/fashion-mnist"
                elif re.search(r"(^|\s)python3\s", c) and not py:
                    why = "no python3 with torch and numpy (Debian: python3-torch)"
                elif (re.search(r"(^|\s)python3\s.*--init", c) or "course_simplenet.sh" in c) and not py_st:
                    why = "no python3 with torch, numpy and safetensors (pip install safetensors)"
                elif re.search(r"(^|\s)(mpicc|mpirun)\s", c) and not have_mpi:
                    why = "no mpicc or mpirun (Debian: openmpi-bin libopenmpi-dev)"
                if why:
                    skip("%s: %s: %s" % (name, c, why))
                    continue
                try:
                    r = subprocess.run(["sh", "-c", c], cwd=clone, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
                    out, rc = r.stdout.decode(errors="replace"), r.returncode
                except subprocess.TimeoutExpired as e:
                    out, rc = (e.stdout or b"").decode(errors="replace"), "timeout 600 s"
                nrun += 1
                outputs[idx] = out
                if rc == 0:
                    ok("%s: %s" % (name, c))
                else:
                    fail("%s: %s (exit %s)" % (name, c, rc), out)
        with lock:
            for k in KEEP:
                if os.path.exists(os.path.join(clone, k)) and not os.path.exists(os.path.join(kept, k)):
                    os.makedirs(os.path.dirname(os.path.join(kept, k)), exist_ok=True)
                    shutil.copy2(os.path.join(clone, k), os.path.join(kept, k))
        emit("       (%s: %d commands in a fresh copy, %.0f s)" % (name, nrun, time.time() - t0))
        check_outputs(name, bl, allcmds, outputs)
        for lang in (EN, ZH):
            if os.path.exists(os.path.join(lang, name)):
                check_tables(os.path.join(lang, name), allcmds, outputs)
        shutil.rmtree(clone, ignore_errors=True)

    # One file at a time until one has built the emulator's libraries (the others keep them), then
    # COURSE_JOBS at a time (default: one per core), each in its own copy, its lines shown
    # together when it ends, in the files' order.
    names = list(ORDER)
    while names and not all(os.path.exists(os.path.join(kept, k)) for k in KEEP):
        lesson(names.pop(0))
    jobs = int(os.environ.get("COURSE_JOBS") or os.cpu_count() or 2)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for lines in pool.map(buffered, [lesson] * len(names), names):
            for line in lines:
                print(line, flush=True)


def check_outputs(name, bl, cmds, outputs):
    for b in bl:
        if b["kind"] != "text":
            continue
        m = b["markers"]
        where = "%s line %d" % (name, b["line"])
        if "course-illustrative" in m:
            emit("       (%s: illustrative, not checked: %s)" % (where, m["course-illustrative"][0]))
            continue
        if "course-output" not in m:
            fail("%s: a quoted output with neither course-output nor course-illustrative above it" % where)
            continue
        idx = [find_cmd(cmds, c) for c in m["course-output"]]
        missing = [c for c, i in zip(m["course-output"], idx) if i < 0]
        if missing:
            fail("%s: course-output names '%s', which is not one of the file's commands" % (where, missing[0]))
            continue
        if any(i not in outputs for i in idx):
            skip("%s: the output of '%s': the command did not run here" % (where, " + ".join(m["course-output"])))
            continue
        outlines = [l.rstrip() for i in idx for l in outputs[i].splitlines()]
        varies = m.get("course-varies", [])
        last = m.get("course-varies-last", [])
        tol = float(m["course-numbers-within"][0]) if "course-numbers-within" in m else None
        wrong, checked, skipped = [], 0, 0
        for l in b["lines"]:
            if not l.strip():
                continue
            if any(v in l for v in varies):
                skipped += 1
                continue
            checked += 1
            if any(v in l for v in last):
                if not any(o.split()[:-1] == l.split()[:-1] for o in outlines):
                    wrong.append(l)
            elif not line_matches(l, outlines, tol):
                wrong.append(l)
        if wrong:
            fail("%s: the quoted output of '%s' has %d line(s) the program did not print, the first: '%s'"
                 % (where, " + ".join(m["course-output"]), len(wrong), wrong[0].strip()),
                 "it printed:\n" + "\n".join(outlines[-12:]))
        else:
            ok("%s: the quoted output of '%s' (%d lines as printed%s)"
               % (where, " + ".join(m["course-output"]), checked, ", %d that vary" % skipped if skipped else ""))


def check_tables(path, cmds, outputs):
    """Markdown tables whose columns quote numbers a command printed (course-table-column)."""
    lines = open(path, encoding="utf-8").read().split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"<!-- course-table-column: (\d+)(?: within ([0-9.e-]+))?: (.*) -->$", line)
        if not m:
            continue
        col, tol, cmd = int(m.group(1)), m.group(2), m.group(3)
        where = "%s line %d" % (path, i + 1)
        k = find_cmd(cmds, cmd)
        if k < 0:
            fail("%s: course-table-column names '%s', which is not one of the file's commands" % (where, cmd))
            continue
        if k not in outputs:
            skip("%s: column %d of the table: '%s' did not run here" % (where, col, cmd))
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("|"):
            j += 1
        rows = []
        while j < len(lines) and lines[j].startswith("|"):
            rows.append(lines[j])
            j += 1
        cells = [r.strip().strip("|").split("|")[col - 1].strip() for r in rows[2:] if len(r.strip().strip("|").split("|")) >= col]
        cells = [c for c in cells if c]
        if tol is None:
            wrong = [c for c in cells if not re.search(r"(?<![\d.])%s(?![\d])" % re.escape(c), outputs[k])]
        else:
            printed = [float(x) for x in NUMBER.findall(outputs[k])]
            wrong = [c for c in cells if not any(abs(float(c) - x) <= float(tol) for x in printed)]
        if not cells or wrong:
            fail("%s: column %d of the table: %s not printed by '%s'" % (where, col, ", ".join(wrong) or "no cells", cmd))
        else:
            ok("%s: column %d of the table, %d numbers, as '%s' printed them%s"
               % (where, col, len(cells), cmd, " (within %s)" % tol if tol else ""))


def same_blocks():
    """The Chinese files show the same commands, outputs and markers as the English ones."""
    for name in ORDER:
        en, zh = os.path.join(EN, name), os.path.join(ZH, name)
        if not (os.path.exists(en) and os.path.exists(zh)):
            continue
        a = [b for b in blocks(en) if b["kind"] in ("sh", "text")]
        z = [b for b in blocks(zh) if b["kind"] in ("sh", "text")]
        bad = ""
        if len(a) != len(z):
            bad = "%d sh and text blocks in en, %d in zh" % (len(a), len(z))
        for x, y in zip(a, z):
            if bad:
                break
            if x["markers"] != y["markers"]:
                bad = "markers differ above en line %d and zh line %d" % (x["line"], y["line"])
            elif x["kind"] == "sh" and commands(x) != commands(y):
                bad = "commands differ: en line %d, zh line %d" % (x["line"], y["line"])
            elif x["kind"] == "text" and "course-output" in x["markers"] and x["lines"] != y["lines"]:
                bad = "quoted outputs differ: en line %d, zh line %d" % (x["line"], y["line"])
        if bad:
            fail("%s: en and zh: %s" % (name, bad))
        elif a:
            ok("%s: en and zh show the same %d blocks of commands and outputs, and the same markers" % (name, len(a)))


# ---- the Chinese text --------------------------------------------------------------------------

CJK = "\u3400-\u9fff\uf900-\ufaff"


def prose(path):
    """(line number, text) of a file's prose: code blocks, inline code, link targets, HTML comments
    and URLs removed."""
    out, code = [], False
    for n, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
        if line.startswith("```"):
            code = not code
            continue
        if code or line.startswith("<!--"):
            continue
        t = re.sub(r"``.*?``|`[^`]*`", " ", line)
        t = re.sub(r"\]\([^)]*\)", "]", t)
        t = re.sub(r"https?://\S+", " ", t)
        out.append((n, t))
    return out


def terms():
    """The glossary's terminology list: [(term, [forbidden variants])]."""
    rows, on = [], False
    for line in open(os.path.join(ZH, "glossary.md"), encoding="utf-8"):
        if line.startswith("## "):
            on = line.strip() == "## 术语规范"
            continue
        if on and line.startswith("|") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 3 and cells[0] != "概念":
                variants = [v.strip() for v in re.split(r"[、，]", cells[2]) if v.strip()]
                rows.append((cells[1], variants))
    return rows


PROSE_WORDS = ["the", "an", "of", "before", "after", "then", "across", "each", "its", "and", "or",
               "per", "every", "both", "between", "back", "one", "on", "to", "from", "by", "its"]


def zh_checks():
    files = [f for f in ORDER if os.path.exists(os.path.join(ZH, f))]
    rows = terms()
    if len(rows) < 3:
        fail("zh/glossary.md has a terminology list (## 术语规范: concept | term | forbidden variants)")
    else:
        ok("zh/glossary.md: the terminology list, %d terms: %s" % (len(rows), "; ".join(
            "%s (not %s)" % (t, "、".join(v)) for t, v in rows)))
    for f in files:
        path = os.path.join(ZH, f)
        text = prose(path)
        problems = []
        in_list = False
        for n, t in text:
            if f == "glossary.md":
                if t.startswith("## "):
                    in_list = t.strip() == "## 术语规范"
                if in_list:
                    continue
            for term, variants in rows:
                for v in variants:
                    if v in t:
                        problems.append("line %d: '%s' (the glossary's term: %s)" % (n, v, term))
        if problems:
            fail("zh/%s: %d variant(s) the glossary forbids, %s" % (f, len(problems), problems[0]),
                 "\n".join(problems))
        else:
            ok("zh/%s: only the glossary's terms" % f)
        # punctuation: half-width , ; : ! ? ( ) beside a Chinese character
        bad = []
        for n, t in text:
            for m in re.finditer(r"[%s][,;:!?()]|[,;:!?()][%s]|[%s] [,;:!?]" % (CJK, CJK, CJK), t):
                bad.append("line %d: '%s'" % (n, t[max(0, m.start() - 6):m.end() + 6].strip()))
            if re.search(r"[%s][^`]*[^\s`][,:;]$" % CJK, t):
                bad.append("line %d: '%s' (a Chinese sentence's half-width punctuation at the end of the line)" % (n, t[-12:]))
            if '"' in t:
                bad.append("line %d: a straight quote \" (use “”)" % n)
            if re.search(r"(?<![*A-Za-z0-9])\*[^*\s][^*]*[%s][^*]*\*(?!\*)" % CJK, t):
                bad.append("line %d: italics on Chinese words" % n)
        if bad:
            fail("zh/%s: %d place(s) of half-width punctuation, straight quotes or italics in Chinese, %s"
                 % (f, len(bad), bad[0]), "\n".join(bad))
        else:
            ok("zh/%s: full-width punctuation, “” quotes, no italics on Chinese words" % f)
        # English prose: four or more English words in a row outside code (names such as
        # "Fashion-MNIST" are one word)
        eng = []
        for n, t in text:
            for m in re.finditer(r"(?:\b[A-Za-z][A-Za-z'-]*\b[ ,]+){3,}\b[A-Za-z][A-Za-z'-]*\b", t):
                eng.append("line %d: '%s'" % (n, m.group(0)))
        # English prose in code font, in the table: its PyTorch and mgpu columns hold code only;
        # what a row means is said in Chinese beside it (the lessons quote programs' English
        # output in code font, which is not prose to translate)
        code, cb = [], False
        for n, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
            if line.startswith("```"):
                cb = not cb
                continue
            if cb:
                continue
            for span in re.findall(r"`([^`]+)`", line):
                words = re.sub(r"\"[^\"]*\"|'[^']*'", " ", span)
                if f == "table.md" and re.search(r"(?<![.\w])(%s)(?![\w(])" % "|".join(PROSE_WORDS), words):
                    eng.append("line %d: `%s`" % (n, span))
        if eng:
            fail("zh/%s: %d run(s) of English prose outside code, %s" % (f, len(eng), eng[0]), "\n".join(eng))
        else:
            ok("zh/%s: no English prose outside code" % f)
        if re.match(r"\d\d-", f):
            head = open(path, encoding="utf-8").readline().rstrip("\n")
            if re.match(r"# 第 %s 课：\S" % f[:2], head):
                ok("zh/%s: the heading '%s'" % (f, head))
            else:
                fail("zh/%s: the heading '%s' does not start '# 第 %s 课：'" % (f, head, f[:2]))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "commands":
        same_blocks()
        run_commands(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "", sys.argv[4:])
    elif len(sys.argv) == 2 and sys.argv[1] == "zh":
        zh_checks()
    else:
        print(__doc__)
        sys.exit(2)
    done()
