"""The docs cannot drift: docs/flags.md is what docs/make_flags.py writes from the parser, and every relative link
and every project path that README.md and docs/*.md name exists."""

import re
import sys

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path in backquotes whose first part is one of the project's top-level entries: `slurm/dlojz_env.sh`,
# `dlojz_lib/data/jpeg.c`, `tests/fixtures/`. Placeholders (<x>, *, $VAR, JOB) are not paths.
CODE = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def project_paths(text):
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    tops = {path.name for path in ROOT.iterdir() if not path.name.startswith(".") and path.name not in ignored}
    tops.add(".ci")
    for token in CODE.findall(text):
        token = token.rstrip(".,:;")
        if re.search(r"[<>*$\[\]{}()=]|JOB|NAME|RUN\b", token) or token.startswith(("-", "/", "~", "http")):
            continue
        first = token.split("/")[0]
        if first in tops and ("/" in token or re.fullmatch(r"[\w.-]+\.(py|toml|txt|ini|md)", token)):
            yield token
        elif re.fullmatch(r"dlojz\w*\.(py|c)", token):  # a module named bare: one of the commands at the root
            yield token


def test_the_flags_page_is_the_parser_s():
    sys.path.insert(0, str(ROOT / "docs"))
    from make_flags import PAGE, flags_markdown

    assert PAGE.read_text() == flags_markdown(), "docs/flags.md is stale: run python docs/make_flags.py"


def test_every_relative_link_and_project_path_in_the_docs_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
                if not (page.parent / target.split("#")[0]).exists():
                    missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for path in project_paths(text):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_the_path_check_sees_a_path_that_is_gone():
    assert list(project_paths("see `dlojz_lib/gone.py`, `slurm/<script>`, `runs/JOB/x` and `dlojz_data.py`")) == [
        "dlojz_lib/gone.py",
        "dlojz_data.py",
    ]
