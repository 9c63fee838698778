#!/usr/bin/env python3
"""Lines of Rust per crate (src/ and tests/ apart) and the largest source files, at the working
tree or at a git revision:

    python3 scripts/lint/code_stats.py            # the working tree
    python3 scripts/lint/code_stats.py REV        # e.g. the commit before a change
"""
import subprocess
import sys
from collections import defaultdict


def files(rev: str | None) -> dict[str, int]:
    if rev:
        names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "crates", "fuzz"],
                               check=True, capture_output=True, text=True).stdout.split()
        out = {}
        for n in names:
            if n.endswith(".rs"):
                text = subprocess.run(["git", "show", f"{rev}:{n}"], check=True, capture_output=True).stdout
                out[n] = text.count(b"\n")
        return out
    names = subprocess.run(["git", "ls-files", "crates", "fuzz"], check=True, capture_output=True, text=True).stdout.split()
    return {n: open(n, "rb").read().count(b"\n") for n in names if n.endswith(".rs")}


def main() -> None:
    lines = files(sys.argv[1] if len(sys.argv) > 1 else None)
    per = defaultdict(lambda: [0, 0])
    for name, n in lines.items():
        parts = name.split("/")
        crate = "fuzz" if parts[0] == "fuzz" else "/".join(parts[:2])
        per[crate][0 if "/src/" in name or parts[0] == "fuzz" else 1] += n
    print(f"{'crate':24} {'src':>7} {'tests':>7}")
    for crate, (src, tests) in sorted(per.items()):
        print(f"{crate:24} {src:>7} {tests:>7}")
    print("largest source files:")
    for name, n in sorted(((k, v) for k, v in lines.items() if "/src/" in k), key=lambda kv: -kv[1])[:5]:
        print(f"  {n:>6}  {name}")


if __name__ == "__main__":
    main()
