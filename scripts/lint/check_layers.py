#!/usr/bin/env python3
"""Checks the library's layering (ARCHITECTURE.md "Rules"): which top-level module of
`crates/tessera/src` may name which, read from every `crate::<module>` path in the code, and
that no two files name each other (directly or around a circle). Exits 1 naming each arrow
that breaks a rule and each circle.

    python3 scripts/lint/check_layers.py
"""
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "crates/tessera/src"

# What each layer may use besides itself. `error` is the floor; `storage`, `comm` and
# `threads` (the engines' thread helpers) are leaves; `save` may ask `load` what a location holds, never the reverse.
ALLOWED = {
    "error": set(),
    "model": {"error"},
    "storage": {"error"},
    "threads": set(),
    "comm": {"error", "model"},
    "format": {"error", "model", "storage"},
    "plan": {"error", "model", "format", "storage"},
    "formats": {"error", "model", "format", "plan", "storage"},
    "load": {"error", "model", "format", "formats", "plan", "storage", "comm", "threads"},
    "save": {"error", "model", "format", "formats", "plan", "storage", "comm", "threads", "load"},
    "tools": {"error", "model", "format", "formats", "plan", "storage", "comm", "threads", "load", "save"},
    # The memory tier and its manager: built on the engines (a copy is a native save, a restore
    # a load, a drain a save from the copy), beside `tools`, never used by them.
    "memory_tier": {"error", "model", "format", "formats", "plan", "storage", "comm", "threads", "load", "save"},
}


def module_of(path: Path) -> list[str]:
    """`src/formats/dcp/mod.rs` → ["formats", "dcp"]; `src/load/open.rs` → ["load", "open"]."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "mod":
        parts.pop()
    return parts


def code(text: str) -> str:
    """The text without comments, tests and string literals (a doc comment may name anything)."""
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests", text)[0]
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def main() -> int:
    files = {tuple(module_of(p)): p for p in SRC.rglob("*.rs") if p.name not in ("lib.rs", "test_rng.rs")}
    errors = []
    edges: dict[tuple, set] = {m: set() for m in files}
    for mod, path in files.items():
        body = code(path.read_text())
        layer = mod[0]
        for target in re.findall(r"\bcrate::((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", body):
            segs = target.split("::")
            if segs[0] not in ALLOWED:
                errors.append(f"{path.relative_to(SRC)}: crate::{target} goes through the crate root (lib.rs)")
                continue
            if segs[0] != layer and segs[0] not in ALLOWED[layer]:
                errors.append(f"{path.relative_to(SRC)}: {layer} may not use {segs[0]} (crate::{target})")
            # The longest known file module the path names.
            for n in range(len(segs), 0, -1):
                if tuple(segs[:n]) in files and tuple(segs[:n]) != mod:
                    edges[mod].add(tuple(segs[:n]))
                    break
        # `super::` paths stay inside the layer but can still tie two files into a circle: from
        # `a/b/c.rs` or `a/b/c/mod.rs` (module a::b::c) each `super` goes up one module.
        for ups, rest in re.findall(r"\b((?:super::)+)((?:[a-z_][a-z0-9_]*::)*[a-z_][a-z0-9_]*)", body):
            segs = list(mod[: len(mod) - ups.count("super::")]) + rest.split("::")
            for n in range(len(segs), 0, -1):
                if tuple(segs[:n]) in files and tuple(segs[:n]) != mod:
                    edges[mod].add(tuple(segs[:n]))
                    break
    # Circles between files: a depth-first search for back edges.
    state: dict[tuple, int] = {}
    stack: list[tuple] = []

    def visit(m: tuple) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                circle = stack[stack.index(t):] + [t]
                errors.append("circle: " + " → ".join("::".join(c) for c in circle))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    sys.setrecursionlimit(10000)
    for m in sorted(edges):
        if m not in state:
            visit(m)
    for e in errors:
        print(e)
    n_edges = sum(len(v) for v in edges.values())
    print(f"{len(files)} files, {n_edges} arrows between them: "
          + ("layering holds, no circles" if not errors else f"{len(errors)} problems"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
