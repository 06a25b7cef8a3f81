"""Check every relative markdown link (and #anchor) in README.md and docs/*.md resolves.

Usage: python .ci/check_links.py [REPO_ROOT]; exit 1 and one line per broken link otherwise."""

import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slugs(p):
    out, seen = set(), {}
    in_code = False
    for line in p.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"^#{1,6} (.*)", line)
        if m:
            s = m.group(1).strip().lower()
            s = re.sub(r"[^\w\- ]", "", s).replace(" ", "-")
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


bad = total = 0
for f in files:
    text = f.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        total += 1
        path, _, anchor = target.partition("#")
        dest = (f.parent / path) if path else f
        if not dest.exists():
            print(f"MISSING {f.relative_to(root)}: {target}")
            bad += 1
            continue
        if anchor and dest.suffix == ".md" and anchor not in slugs(dest):
            print(f"BAD ANCHOR {f.relative_to(root)}: {target}")
            bad += 1
print(f"{total} relative links checked, {bad} broken")
sys.exit(1 if bad else 0)
