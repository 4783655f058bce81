"""docs/pretrained.md's tables agree with the pipeline families (src/diffrelay/families/): the network row's classes
and archs, one encoders row per family with its token lengths, the LoRA default targets, and the memory table
against benchmarks/results/pretrained_memory.json and the families' published rows. Torch-free."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

from diffrelay.families import FAMILIES

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "pretrained.md").read_text().splitlines()
MEMORY = json.loads((REPO / "benchmarks" / "results" / "pretrained_memory.json").read_text())["results"]


def table(header: str) -> list[list[str]]:
    """The cells of each row of the table whose header line starts with `header`."""
    start = next(i for i, line in enumerate(PAGE) if line.startswith(header))
    rows = []
    for line in PAGE[start + 2:]:
        if not line.startswith("|"):
            return rows
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def test_the_network_row_names_each_familys_class_and_arch():
    row = next(r for r in table("| part | from | becomes") if r[0] == "network")
    assert set(re.findall(r"`(\w+)` = `([\w-]+)`", row[2])) == {(f.network_class, f.arch) for f in FAMILIES}


def test_the_encoders_table_has_a_row_per_family_with_its_token_lengths():
    rows = {re.sub(r" \(.*", "", r[0]): r[1] for r in table("| family | encoders")}
    for f in FAMILIES:
        labels = [label for label in rows if label in (f.name, f.short)]
        assert len(labels) == 1, (f.name, f.short, list(rows))
        written = {int(n) for group in re.findall(r"(\d+(?: / \d+)*) tokens", rows[labels[0]])
                   for n in group.split(" / ")}
        lengths = {s["max_length"] for p in f.pipelines
                   for _, s in f.encoders(SimpleNamespace(cls=p))[0] if "max_length" in s}
        assert written == lengths, f.name
    for label, text in rows.items():  # a row of no family's reads "as <family's short name>" (SD3.5's)
        alias = re.match(r"as (\S+)", text)
        assert any(label in (f.name, f.short) for f in FAMILIES) or alias and alias[1] in {f.short for f in FAMILIES}


def test_the_lora_default_row_names_every_familys_targets():
    row = next(r for r in table("| key | default | meaning") if r[0] == "`target_modules`")
    names = {n for span in re.findall(r"`([^`]+)`", row[1]) for n in re.findall(r"[\w.]+", span)}
    for f in FAMILIES:
        missing = [t for t in f.lora_targets if t not in names and t.removeprefix("attn.") not in names]
        assert not missing, (f.short, missing)


def test_the_memory_table_has_a_row_per_published_network_with_the_measured_counts():
    published = {name: spec for f in FAMILIES for name, spec in f.published.items()}
    assert sorted(MEMORY) == sorted(published)
    rows = table("| pipeline | parameters")
    assert len(rows) == len(published)
    for name, spec in published.items():
        result = MEMORY[name]  # measured from this row: benchmarks/pretrained_memory.py again after a change
        assert (result["config"], result["published_params"]) == (spec["repo"], spec["published"]), name
        full, lora = f"{result['full']['params']:,}", f"{result['lora']['trainable']:,}"
        assert [r[1] for r in rows].count(full) == 1, (name, full)
        assert any(r[1] == full and r[5].startswith(lora) for r in rows), (name, lora)
