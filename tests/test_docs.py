"""The documentation is part of the product: the site builds strictly (no broken link or anchor, every page in the
nav), its option tables come from the code, every ASERVE_* variable the code reads is documented, the README stays a
short front door whose set-up commands are the ones CI runs, and nothing points outside the repository."""
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from aserve.config import EngineConfig, _flag

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return listed.stdout.split()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_strictly_with_the_engine_options_generated_from_the_code(site):
    page = (site / "engine-options" / "index.html").read_text()
    for f in fields(EngineConfig):
        assert f"<code>{_flag(f)}</code>" in page, f"{f.name} is missing from the engine options page"
    assert "table:" not in page  # every marker was replaced
    serving = (site / "serving" / "index.html").read_text()
    assert "<code>--request-timeout</code>" in serving and "<code>--port</code>" in serving


def nav_pages(entries) -> set[str]:
    pages = set()
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries without a page"


def test_every_aserve_variable_the_code_reads_is_documented():
    documented = (DOCS / "environment.md").read_text()
    read = set()
    for folder in ("aserve", "policies", "tools", "load_tests", "benchmarks", "tests", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh"):
                read |= set(re.findall(r"\bASERVE_[A-Z][A-Z_]*\b", path.read_text(errors="ignore")))
    assert read, "found no ASERVE_* variable at all: the scan is broken"
    missing = sorted(v for v in read if f"`{v}`" not in documented)
    assert not missing, f"undocumented in docs/environment.md: {missing}"


def test_the_readme_is_a_short_front_door_opening_with_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    opening = re.match(r"# aserve\n\n```bash\n(.*?)\n```\n", readme, re.DOTALL)
    assert opening, "the README opens with its title and the set-up commands"
    install, test = opening.group(1).split("\n")
    assert install.endswith("&& aserve") and test.endswith("python -m pytest -q")
    assert test in (ROOT / ".ci" / "run").read_text(), "CI runs the README's second command"


def test_nothing_points_outside_the_repository():
    tracked_files()
    outside = "../" + "shared"  # spelled in two pieces so this file does not match itself
    found = subprocess.run(["git", "grep", "-n", "-F", outside], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 1, f"tracked files mention {outside}:\n{found.stdout}"
