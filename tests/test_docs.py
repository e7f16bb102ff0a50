"""The documentation holds together: README.md stays a front page whose first `make test` is what CI runs,
and every relative link in README.md and docs/*.md names a file that exists and, with a `#fragment`, a
heading of that file (anchors as GitHub makes them)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
EXPECTED_DOCS = {
    "api",
    "configuration",
    "operations",
    "deploying",
    "architecture",
    "models",
    "quantization",
    "batch-invariance",
    "performance",
    "gpu",
    "testing",
}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        seen = counts.get(base, 0)
        counts[base] = seen + 1
        found.add(base if seen == 0 else f"{base}-{seen}")
    return found


def links(path: Path) -> list[str]:
    targets = []
    for line in prose_lines(path.read_text()):
        targets.extend(LINK.findall(INLINE_CODE.sub("", line)))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto:


def test_the_docs_pages_exist():
    assert {p.stem for p in PAGES if p.parent.name == "docs"} >= EXPECTED_DOCS


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[:6] == ["# pagedserve", "", "```sh", "make serve", "make test", "```"]


def test_readmes_first_make_test_is_what_ci_runs():
    first = next(line.strip() for line in README.read_text().splitlines() if "make test" in line)
    assert first in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        file_part, _, fragment = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: no heading #{fragment} in {path.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_fences_close_cleanly(page):
    """A closing fence holds nothing but the fence (CommonMark): text after it (docs/configuration.md had
    "``` A request names an adapter") leaves the block open, and the rest of the page renders as code."""
    bad, opened_at = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        match = re.match(r"^\s*(```|~~~)(.*)$", line)
        if match is None:
            continue
        if opened_at is None:
            opened_at = number
        else:
            if match.group(2).strip():
                bad.append(f"line {number}: {line!r} (text after a closing fence)")
            opened_at = None
    if opened_at is not None:
        bad.append(f"line {opened_at}: a fence never closed")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_slug_matches_githubs():
    assert (
        slug("GGUF weights kept quantized (`--quantization gguf`)") == "gguf-weights-kept-quantized---quantization-gguf"
    )
    assert slug("Where a step's time goes") == "where-a-steps-time-goes"
    assert slug("int8, int4 and AWQ weights") == "int8-int4-and-awq-weights"


def test_testing_page_names_every_test_folder_and_top_level_test_file():
    """docs/testing.md says what each folder of tests/ checks: a folder or top-level test file it never names
    is a part of `make test` a reader cannot find there (tests/lora was missing)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    tests = ROOT / "tests"
    folders = [p for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))]
    files = list(tests.glob("test_*.py"))
    missing = [
        name
        for name in [f"`tests/{p.name}`" for p in folders] + [f"`tests/{p.name}`" for p in files]
        if name not in text
    ]
    assert not missing, f"docs/testing.md names none of: {', '.join(sorted(missing))}"


def _served_metric_names() -> set[str]:
    """Every metric /metrics can serve, named as the exposition shows it (a counter's `_total`, an info's `_info`):
    the server's families with speculation, both KV tiers and a GPU reading on, and the LoRA collector's."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from engine.lora.lora_manager import LoRAStats
    from scheduler import KVTierStats, SchedulerStats, SpecDecodeStats
    from server.observability.gpu_monitor import GpuSample
    from server.observability.lora_metrics import LoRACollector
    from server.observability.metrics import ServerMetrics, cache_info

    tiers = (KVTierStats("memory"), KVTierStats("disk"))
    stats = SchedulerStats(1, 0, 0.5, 0, 10, 5, SpecDecodeStats(1, 3, 2, [1, 1, 0]), tiers)
    metrics = ServerMetrics("m", lambda: stats, cache_info(8, 16, True, "auto", "cpu", 128))
    metrics.gpu_monitor = SimpleNamespace(samples=[GpuSample("0", 0.5, 1, 2)])  # type: ignore[assignment]
    metrics.registry.register(LoRACollector("m", lambda: LoRAStats(["a"], [], 4, {"a": 1})))
    suffix = {"counter": "_total", "info": "_info"}
    return {
        family.name + suffix.get(family.type, "")
        for family in text_string_to_metric_families(metrics.render().decode())
        if not family.name.endswith("_created")  # prometheus-client's creation times beside each counter
    }


def test_operations_lists_every_metric_the_server_serves():
    """docs/operations.md's metrics table names every family /metrics can show, and only those."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("\n## Metrics\n") :]
    section = section[: section.index("\n## ", 1)]
    documented = {name for name in re.findall(r"`(pagedserve_[a-z0-9_]+)", section) if not name.endswith("_")}
    served = _served_metric_names()
    assert len(served) >= 30
    assert not served - documented, f"served but not in docs/operations.md#metrics: {sorted(served - documented)}"
    assert not documented - served, f"in docs/operations.md#metrics but never served: {sorted(documented - served)}"
