"""The published figures' tables agree with the committed JSON they are rendered from.

`make docs-check` runs the same check; this test makes CI (`make test`) fail on a table edited
by hand or a JSON replaced without `make docs`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import docs_tables

REPO = Path(__file__).resolve().parents[1]


def test_committed_tables_match_their_json() -> None:
    assert docs_tables.stale(REPO) == []


def test_every_table_is_published_somewhere() -> None:
    text = "".join(p.read_text() for p in docs_tables.pages(REPO))
    missing = [n for n in docs_tables.TABLES if f"<!-- table:{n} -->" not in text]
    assert missing == []


def test_readme_carries_the_headline_table() -> None:
    assert "<!-- table:main-job-headline -->" in (REPO / "README.md").read_text()


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the pages and the published JSON, to change without touching the checkout."""
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copytree(REPO / docs_tables.PUBLISHED, tmp_path / docs_tables.PUBLISHED)
    docs_tables._load.cache_clear()
    yield tmp_path
    docs_tables._load.cache_clear()


def test_a_changed_json_makes_its_tables_stale_until_regenerated(copy: Path) -> None:
    run = copy / docs_tables.PUBLISHED / docs_tables.MAIN_RUNS[0]
    report = json.loads(run.read_text())
    report["comparisons"]["vllm-rr"]["ratios"]["req_per_s"] = 9.87
    run.write_text(json.dumps(report))
    bad = docs_tables.stale(copy)
    assert "README.md: main-job-headline" in bad
    assert docs_tables.main(["--check", "--root", str(copy)]) == 1
    assert docs_tables.main(["--root", str(copy)]) == 0
    assert docs_tables.stale(copy) == []
    assert "×9.87" in (copy / "README.md").read_text()


def test_a_hand_edited_table_is_stale(copy: Path) -> None:
    readme = copy / "README.md"
    text = readme.read_text()
    start = text.index("<!-- table:main-job-headline -->")
    cell = re.search(r"×\d+\.\d\d", text[start:])  # the table's first ratio, whatever it is
    assert cell is not None
    at = start + cell.start()
    readme.write_text(text[:at] + "×99.99" + text[at + len(cell.group()):])
    assert docs_tables.stale(copy) == ["README.md: main-job-headline"]


def test_an_unknown_table_name_is_refused(copy: Path) -> None:
    page = copy / "docs" / "benchmarks.md"
    page.write_text(page.read_text() + "\n<!-- table:no-such -->\n<!-- /table:no-such -->\n")
    with pytest.raises(KeyError, match="no-such"):
        docs_tables.stale(copy)
    assert docs_tables.main(["--check", "--root", str(copy)]) == 1


def test_links_are_relative_to_the_page() -> None:
    doc = docs_tables.Doc(REPO, Path("docs"))
    assert doc.link("disk-tier.json") == \
        "[disk-tier.json](../bench/results/published/disk-tier.json)"


def test_every_relative_link_in_the_docs_resolves() -> None:
    """Pages moved between README.md and docs/, and the JSON moved under bench/: a link left
    pointing at the old place fails here."""
    broken = []
    for page in [*docs_tables.pages(REPO), REPO / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


def test_a_result_records_when_how_and_where_it_ran(tmp_path: Path) -> None:
    """A published table names its run's date, command and machine from the JSON itself."""
    from bench.common import write_result

    out = tmp_path / "nested" / "x.json"
    write_result(out, {"value": 1})
    run = json.loads(out.read_text())["run"]
    assert run["created"].endswith("Z") and len(run["created"]) == 20
    assert isinstance(run["argv"], list)
    assert run["machine"]["cpus"] >= 1 and run["machine"]["python"]
    write_result(out, {"value": 2, "run": {"created": "kept"}})
    assert json.loads(out.read_text())["run"] == {"created": "kept"}


def test_every_published_result_says_when_it_ran() -> None:
    """The main job's reports carry `created` and `machine`; every bench's JSON its `run`."""
    missing = []
    for path in sorted((REPO / docs_tables.PUBLISHED).rglob("*.json")):
        report = json.loads(path.read_text())
        if not (report.get("run", {}).get("created") or report.get("created")
                or report.get("host")):
            missing.append(str(path.relative_to(REPO)))
    assert missing == []


def test_a_markdown_table_has_its_rule_and_rows() -> None:
    assert docs_tables._md(["a", "b"], [["1", "2"]]) == ["| a | b |", "| --- | --- |",
                                                        "| 1 | 2 |"]
