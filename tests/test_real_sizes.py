"""The computed sizes of the real 26B-A4B that BENCHMARKS.md and docs/models.md print are what `python
scripts/real_sizes.py` prints now (dgemma_cli/checkpoint/footprint.py's arithmetic on the published config's shapes):
a change to the estimate that leaves the documents behind fails here."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "### Sizes of the real 26B-A4B per format (computed)"


def script_table() -> list[str]:
    p = subprocess.run([sys.executable, "scripts/real_sizes.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()


def test_benchmarks_sizes_table_is_the_scripts_output():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert text.count(HEADING) == 1
    section = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| format | policy |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert lines[start:end] == script_table()


def test_models_doc_quotes_the_scripts_8k_estimates():
    rows = {tuple(c.strip() for c in line.strip("|").split("|"))[:2]: line.strip("|").split("|")[8].strip()
            for line in script_table()[2:]}
    said = re.search(r"the estimates at 8k are ([\d.]+) GB \(bf16\), ([\d.]+) GB \(FP8 or INT8\) and ([\d.]+) GB",
                     " ".join((ROOT / "docs" / "models.md").read_text().split()))
    assert said, "docs/models.md no longer quotes the 8k estimates"
    assert rows[("fp8", "all")] == rows[("int8", "all")]
    assert said.groups() == (rows[("bf16", "-")], rows[("fp8", "all")], rows[("nvfp4", "experts")])
