"""`make bench` rewrites RESULTS.md: the tables the separately run benchmarks put there stay."""

from __future__ import annotations

from pathlib import Path

from benchmarks.run import marked_blocks, restore_blocks


def test_a_rewritten_report_keeps_the_tables_other_benchmarks_put_there(tmp_path: Path) -> None:
    report = tmp_path / "RESULTS.md"
    report.write_text(
        "# old run\n\n<!-- clients -->\nthe clients table\n<!-- clients -->\n\n"
        "<!-- cold-big -->\nlast cold-big table\n<!-- cold-big -->\n"
    )
    kept = marked_blocks(report)
    report.write_text("# new run\n\n<!-- cold-big -->\nnew cold-big table\n<!-- cold-big -->\n")  # the rewrite
    restore_blocks(kept, report)

    text = report.read_text()
    assert text.startswith("# new run")
    assert "the clients table" in text, "a table the rewrite did not write is put back"
    assert "new cold-big table" in text and "last cold-big table" not in text, "one it wrote stays as written"
    assert text.count("<!-- clients -->") == 2
