#!/usr/bin/env python3
"""Lists and checks the public surface of the `tessera` crate (ARCHITECTURE.md "Public
surface"): the names at the root of `crates/tessera/src/lib.rs` and those of each public module,
leaving out the doc-hidden `__*` modules (feature-gated doors for fuzz targets, the plan
simulator and tests; not API).

    python3 scripts/lint/public_api.py            # list the working tree's surface
    python3 scripts/lint/public_api.py REV        # lib.rs at a git revision (e.g. before a change)
    python3 scripts/lint/public_api.py --check    # CI: exit 1 naming what breaks a rule

The rules `--check` enforces:
- the root holds at most ROOT_LIMIT names, and the public modules are exactly MODULES;
- every public name is used by something outside the library's sources (the CLI, the binding,
  the benchmarks, tests, fuzz targets, examples) or by a doc example, or is the type of
  something public (a field, an argument, a return value), so that nothing exported is dead;
- no crate includes another crate's files through `#[path]` (shared test code is a crate).
Unnameable public types are refused by the compiler (`unnameable_types` is denied in lib.rs).
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = "crates/tessera/src/lib.rs"
SRC = ROOT / "crates/tessera/src"
ROOT_LIMIT = 36
MODULES = {"comm", "factory", "index", "memory_tier", "olmo", "storage", "tools", "tools::diff", "torch_dist"}
# Real modules whose public items are their own (not façades in lib.rs): module -> file.
REAL = {
    "comm": "comm/mod.rs",
    "memory_tier": "memory_tier/mod.rs",
    "storage": "storage/mod.rs",
    "tools": "tools/mod.rs",
    "tools::diff": "tools/diff.rs",
}


def strip_hidden(src: str) -> str:
    """`src` without the bodies of doc-hidden modules (`pub mod __x { ... }`)."""
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
    return "\n".join(out)


def used_names(text: str) -> list[str]:
    """The names a block of `pub use` / `pub fn|struct|enum|trait|type|const` items makes public."""
    text = re.sub(r"//[^\n]*", "", text)
    names = []
    for group in re.findall(r"pub use [\w:]+::\{([^}]*)\};", text, re.S):
        names += [n.strip().split(" as ")[-1] for n in group.split(",") if n.strip()]
    names += re.findall(r"pub use [\w:]+::(\w+);", text)
    names += re.findall(r"pub use ::(\w+);", text)
    names += re.findall(r"^pub (?:fn|struct|enum|trait|type|const) (\w+)", text, re.M)
    return [n for n in names if n != "self"]


def surface(src: str) -> dict[str, list[str]]:
    """`{"": root names, "module": its names}` from lib.rs (and the real public modules' files)."""
    text = strip_hidden(src)
    modules: dict[str, list[str]] = {}
    # Façade modules written in lib.rs: `pub mod x { ... }`.
    for name, body in re.findall(r"^pub mod (\w+) \{(.*?)^\}", text, re.S | re.M):
        modules[name] = used_names(body)
    root_text = re.sub(r"^pub mod \w+ \{.*?^\}", "", text, flags=re.S | re.M)
    modules[""] = used_names(root_text)
    for name in re.findall(r"^pub mod (\w+);", root_text, re.M):
        modules[name] = []
    for name, rel in REAL.items():
        if (name in modules or "::" in name) and (SRC / rel).exists():
            modules[name] = used_names((SRC / rel).read_text())
    return modules


def consumers() -> str:
    """Everything outside the library's sources that may name the API, plus its doc examples."""
    parts = []
    for pattern in ["crates/*/src/**/*.rs", "crates/*/tests/**/*.rs", "crates/*/examples/*.rs", "fuzz/fuzz_targets/*.rs"]:
        for p in ROOT.glob(pattern):
            if not str(p).startswith(str(SRC)):
                parts.append(p.read_text())
    for p in SRC.rglob("*.rs"):
        parts += [line for line in p.read_text().splitlines() if line.lstrip().startswith(("///", "//!"))]
    return "\n".join(parts)


def signatures() -> str:
    """The library's public signatures and fields: where a type can be public without a user naming it."""
    out = []
    for p in SRC.rglob("*.rs"):
        text = re.sub(r"//[^\n]*", "", p.read_text())
        # Whole signatures of public functions (they span lines), and public fields and types.
        out += [" ".join(m.split()) for m in re.findall(r"\bpub fn [^{;]*", text)]
        out += [line.strip() for line in text.splitlines() if re.match(r"\s*pub \w+\s*:", line)]
    return "\n".join(out)


def check(mods: dict[str, list[str]]) -> list[str]:
    errors = []
    if len(mods[""]) > ROOT_LIMIT:
        errors.append(f"the root has {len(mods[''])} names (at most {ROOT_LIMIT}): {', '.join(sorted(mods['']))}")
    found = {m for m in mods if m}
    if found != MODULES:
        errors.append(f"public modules {sorted(found)}, expected {sorted(MODULES)}")
    users, sigs = consumers(), signatures()
    for mod, names in mods.items():
        for n in names:
            pat = re.compile(rf"\b{re.escape(n)}\b")
            if pat.search(users):
                continue
            # A type used in a public signature of another item is reachable, hence exported.
            if any(pat.search(line) and not re.match(rf"pub (?:struct|enum|trait|type|fn|const) {n}\b", line)
                   for line in sigs.splitlines()):
                continue
            errors.append(f"{'tessera::' + mod + '::' if mod else 'tessera::'}{n} is exported but nothing uses it")
    for p in ROOT.glob("crates/**/*.rs"):
        for m in re.finditer(r'#\[path\s*=\s*"([^"]+)"\]', p.read_text()):
            target = (p.parent / m.group(1)).resolve()
            crate = p.relative_to(ROOT / "crates").parts[0]
            if not str(target).startswith(str(ROOT / "crates" / crate) + "/"):
                errors.append(f"{p.relative_to(ROOT)}: #[path = {m.group(1)!r}] includes another crate's file")
    return errors


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] != "--check":
        src = subprocess.run(["git", "show", f"{args[0]}:{LIB}"], check=True, capture_output=True, text=True).stdout
    else:
        src = (ROOT / LIB).read_text()
    mods = surface(src)
    total = sum(len(v) for v in mods.values())
    print(f"{total} public names: {len(mods[''])} at the root, the rest in {len(mods) - 1} modules")
    for mod in sorted(mods, key=lambda m: (m != "", m)):
        print(f"  {'tessera' if not mod else 'tessera::' + mod}: {', '.join(sorted(set(mods[mod])))}")
    if args[:1] == ["--check"]:
        errors = check(mods)
        for e in errors:
            print("public_api:", e, file=sys.stderr)
        return 1 if errors else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
