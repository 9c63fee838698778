#!/usr/bin/env python3
"""Lists the public names of the `tessera` crate: what `crates/tessera/src/lib.rs` re-exports
(`pub use`) and the public modules, leaving out the doc-hidden `__*` modules (feature-gated
doors for fuzz targets, the plan simulator and tests; not API).

    python3 scripts/lint/public_api.py            # the working tree
    python3 scripts/lint/public_api.py REV        # lib.rs at a git revision (e.g. before a change)
"""
import re
import subprocess
import sys

LIB = "crates/tessera/src/lib.rs"


def public_names(src: str) -> list[str]:
    # Drop the bodies of doc-hidden modules: `pub mod __x { ... }` up to its closing brace.
    out, depth, skipping = [], 0, False
    for line in src.splitlines():
        if re.match(r"\s*pub mod __\w+\s*\{", line):
            skipping, depth = True, 0
        if skipping:
            depth += line.count("{") - line.count("}")
            if depth <= 0 and "}" in line:
                skipping = False
            continue
        out.append(line)
    text = "\n".join(out)
    names = []
    for group in re.findall(r"pub use [\w:]+::\{([^}]*)\};", text):
        names += [n.strip() for n in group.split(",") if n.strip()]
    names += re.findall(r"pub use [\w:]+::(\w+);", text)
    names += re.findall(r"pub use (\w+);", text)
    names += [f"mod {m}" for m in re.findall(r"^pub mod (\w+)", text, re.M) if not m.startswith("__")]
    return sorted(set(names))


def main() -> None:
    if len(sys.argv) > 1:
        src = subprocess.run(["git", "show", f"{sys.argv[1]}:{LIB}"], check=True, capture_output=True, text=True).stdout
    else:
        src = open(LIB).read()
    names = public_names(src)
    print(f"{len(names)} public names")
    print(", ".join(names))


if __name__ == "__main__":
    main()
