"""docs/benchmarks.md is what the result files generate (`python launch/report.py --page`), every
result file matches the schema and names commits of this repository, and the page stays short.
JAX-free: the page's code imports only the stdlib and jsonschema."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.benchmarks import report, schema

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILES = sorted((ROOT / report.RESULTS_DIR).glob("*.json"))


def test_the_committed_page_is_what_the_result_files_generate():
    page = (ROOT / report.PAGE).read_text()
    assert report.render_page(ROOT) == page, (
        f"{report.PAGE} differs from what {report.RESULTS_DIR}/ and {report.SUITE_DIR}/ generate: "
        "run python launch/report.py --page (and commit the page with the result files)")
    assert page.count("\n") <= report.MAX_PAGE_LINES


@pytest.mark.parametrize("path", RESULT_FILES, ids=[p.name for p in RESULT_FILES])
def test_a_result_file_matches_the_schema_and_its_name(path):
    doc = json.loads(path.read_text())
    schema.validate(doc)
    assert path.name == f"{doc['benchmark']}.{doc['machine']['name']}.json"
    areas = [area for area, _ in report.AREAS]
    assert doc["area"] in areas, f"{path.name}: area {doc['area']!r} is not one of {areas}"


def test_every_recorded_commit_is_in_this_repository():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    commits = sorted({c for p in RESULT_FILES for r in json.loads(p.read_text())["records"]
                      for c in (r["commit"], r.get("code")) if c})
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True,
                         text=True, input="".join(f"{c}^{{commit}}\n" for c in commits),
                         timeout=60, check=True).stdout
    unknown = [line.split()[0] for line in out.splitlines() if line.endswith("missing")]
    assert not unknown, f"commits named by result files but not in this repository: {unknown}"


def _record(**changes):
    rec = {"name": "x", "value": 1.5, "unit": "s", "peer": {"name": "p", "value": 3.0},
           "ratio": 0.5, "ratio_rounds": [0.5, 0.4], "ratio_of": "jaxrl / peer",
           "target": "<= 0.67x", "status": "met", "command": "python launch/bench.py x",
           "load": "1.0", "date": "2026-12-01", "commit": "abcdef1"}
    rec.update(changes)
    return rec


def _results(*records, benchmark="x", machine="box", area="Weight sync"):
    return {"schema_version": schema.RESULTS_VERSION, "kind": "results", "benchmark": benchmark,
            "area": area, "machine": {"name": machine, "description": "a test box"},
            "records": list(records) or [_record()]}


def test_the_schema_rejects_broken_result_files():
    schema.validate(_results())
    assert set(report.STATUS_TEXT) == set(schema.RESULT_STATUSES)
    broken = [
        lambda d: d["records"][0].pop("date"),
        lambda d: d["records"][0].__setitem__("date", "Dec 1"),
        lambda d: d["records"][0].__setitem__("commit", "HEAD"),
        lambda d: d["records"][0].__setitem__("correction", "two\nlines"),
        lambda d: d["records"][0].pop("target"),  # met: against what
        lambda d: d["records"][0].pop("ratio_of"),  # a ratio says what it divides
        lambda d: d["records"][0].__setitem__("status", "great"),
        lambda d: d["records"][0].__setitem__("speedup", 2.0),  # a misspelt field
        lambda d: d["records"][0].__setitem__("value", "1.5"),
        lambda d: d["records"][0].pop("command"),  # neither a command nor a method
        lambda d: d.__setitem__("records", []),
        lambda d: d.__setitem__("schema_version", schema.RESULTS_VERSION + 1),
    ]
    for i, breaker in enumerate(broken):
        doc = copy.deepcopy(_results())
        breaker(doc)
        with pytest.raises(schema.SchemaError):
            schema.validate(doc)
            pytest.fail(f"broken result file {i} validated")


def _repo(tmp_path: Path, *docs) -> Path:
    (tmp_path / report.RESULTS_DIR).mkdir()
    (tmp_path / "docs").mkdir()
    for doc in docs:
        name = f"{doc['benchmark']}.{doc['machine']['name']}.json"
        (tmp_path / report.RESULTS_DIR / name).write_text(json.dumps(doc))
    return tmp_path


def test_page_renders_records_as_written_and_sorted(tmp_path):
    corrected = _record(name="fast", headline="the fast one", correction="corrected 2026-12-02: "
                        "the 3x ran one-sided", code="1234567", time="10:00 UTC")
    repo = _repo(tmp_path, _results(_record(name="late area"), benchmark="b", area="Zeta"),
                 _results(corrected, benchmark="a"))
    # numbers print as the file writes them (12.40 stays 12.40)
    raw = (repo / report.RESULTS_DIR / "a.box.json").read_text().replace("1.5", "12.40")
    (repo / report.RESULTS_DIR / "a.box.json").write_text(raw)
    page = report.render_page(repo)
    assert report.render_page(repo) == page  # deterministic
    assert page.index("## Weight sync") < page.index("## Zeta") < page.index("## Machines")
    assert ("| the fast one | 12.40 s | p: 3.0 s | 0.5x (0.5, 0.4), jaxrl / peer | <= 0.67x: met "
            "| [Weight sync](#weight-sync) |") in page
    row = next(line for line in page.splitlines() if line.startswith("| fast"))
    assert "<br>**corrected 2026-12-02: the 3x ran one-sided**" in row
    assert "`python launch/bench.py x` | box; load 1.0 | 2026-12-01 10:00 UTC | abcdef1 (code " \
           "1234567) |" in row
    assert "| box | a test box |" in page


def test_page_command_writes_checks_and_names_a_bad_file(tmp_path, capsys):
    repo = _repo(tmp_path, _results())
    assert report.main(["--page", "--check"], root=repo) == 1
    assert "run python launch/report.py --page" in capsys.readouterr().err
    assert report.main(["--page"], root=repo) == 0
    assert report.main(["--page", "--check"], root=repo) == 0
    assert (repo / report.PAGE).read_text() == report.render_page(repo)
    (repo / report.RESULTS_DIR / "x.box.json").rename(repo / report.RESULTS_DIR / "y.box.json")
    assert report.main(["--page"], root=repo) == 2
    assert "y.box.json" in capsys.readouterr().err  # named <benchmark>.<machine>.json
    (repo / report.RESULTS_DIR / "y.box.json").write_text(json.dumps(_results(_record(date="x"))))
    assert report.main(["--page", "--check"], root=repo) == 2
    assert "y.box.json: records/0/date" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main(["--page", "a.json"], root=repo)


def test_the_page_code_imports_no_jax():
    code = ("import sys; import jaxrl.benchmarks.report; "
            "bad = [m for m in ('jax', 'numpy', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
