#!/usr/bin/env python3
"""sass_diff.py: compare the machine code (SASS) of the kernels of two builds.

    python3 tools/sass_diff.py OLD.o[,OLD2.o...] NEW.o[,NEW2.o...] [--map 'OLD_RE=>NEW'...]

Each object's SASS comes from cuobjdump -sass (CUOBJDUMP, else cuobjdump on
PATH). Kernels are matched by demangled name without the parameter list (c++filt),
after each --map
regular-expression substitution is applied to the old build's names; a
refactor that renames or re-templates a kernel maps the old name onto the
new one. For every kernel of the new build the script prints whether its
SASS is byte-identical to the old one's, how many instructions differ
otherwise (the first few diff lines), or that the old build has no such
kernel; exit status 1 if any kernel differs or is missing. The source file
name line (identifier) is left out; the instructions, their encodings and
offsets are compared: identical means identical.
"""
import os
import re
import subprocess
import sys
import difflib


def sass(objs):
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    funcs = {}
    for obj in objs.split(","):
        out = subprocess.run([tool, "-sass", obj], check=True, capture_output=True, text=True).stdout
        name, body = None, []
        for line in out.splitlines():
            m = re.match(r"\s*Function : (\S+)", line)
            if line.startswith("Fatbin"):  # the next embedded image's header, not this kernel's code
                if name:
                    funcs[name] = body
                name, body = None, []
            elif m:
                if name:
                    funcs[name] = body
                name, body = m.group(1), []
            elif name is not None and line.strip() and not line.strip().startswith((".", "identifier")):
                body.append(line.strip())
        if name:
            funcs[name] = body
    names = list(funcs)
    dem = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    # the name without its parameter list: a refactor may drop a parameter
    # that the kernel does not read (the comparison of the code shows it)
    return {re.sub(r"\(.*\)$", "", d): funcs[n] for n, d in zip(names, dem)}


def main(argv):
    maps, pos = [], []
    it = iter(argv[1:])
    for a in it:
        if a == "--map":
            old, new = next(it).split("=>")
            maps.append((re.compile(old), new))
        else:
            pos.append(a)
    if len(pos) != 2:
        print(__doc__)
        return 2
    old, new = sass(pos[0]), sass(pos[1])
    renamed = {}
    for name, body in old.items():
        for rx, rep in maps:
            name = rx.sub(rep, name)
        if name in renamed:
            print(f"two old kernels map to {name}: fix the --map patterns")
            return 2
        renamed[name] = body
    bad = 0
    for name in sorted(new):
        body = new[name]
        if name not in renamed:
            print(f"MISSING in old: {name}")
            bad += 1
            continue
        ob = renamed[name]
        if ob == body:
            print(f"identical ({len(body)} lines): {name}")
            continue
        bad += 1
        diff = [d for d in difflib.unified_diff(ob, body, lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        print(f"DIFFERENT ({len(ob)} -> {len(body)} lines, {len(diff)} diff lines): {name}")
        for d in diff[:12]:
            print("    " + d)
    print(f"{len(new) - bad} of {len(new)} kernels identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
