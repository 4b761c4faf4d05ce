"""The coverage table in ``docs/coverage.md`` is generated from the corpus tests' tags.

Each corpus test says which transform and option it backs and what it asserts (works,
forward only, error, bridge bug); the test itself enforces that claim. This test renders
the table from the tags and checks docs/coverage.md holds exactly that table, so neither
can drift. Print the current table with ``python -m tests.corpus.test_table``.
"""

import importlib
import pathlib

CORPUS = pathlib.Path(__file__).parent
COVERAGE = CORPUS.parents[1] / "docs" / "coverage.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
# Table order: Linen, NNX, plain JAX, brainstate; files not named here follow, sorted.
ORDER = ("test_linen", "test_linen_flow", "test_linen_autodiff", "test_nnx",
         "test_jax_checkpoint", "test_brainstate")


def corpus_files() -> list[str]:
    found = {p.stem for p in CORPUS.glob("test_*.py")} - {"test_table"}
    return [f for f in ORDER if f in found] + sorted(found - set(ORDER))


def corpus_rows():
    rows = []
    for stem in corpus_files():
        module = importlib.import_module(f"tests.corpus.{stem}")
        for obj in vars(module).values():
            rows.extend(getattr(obj, "corpus_rows", ()))
    return rows


def render_table(rows) -> str:
    """One row per tag, grouped by transform in order of appearance; bridge bugs last."""
    rows = sorted(rows, key=lambda r: r.result == "bridge bug")
    order = list(dict.fromkeys(r.transform for r in rows))
    lines = ["| Transform | Example / option | Across the bridge | Test |",
             "|---|---|---|---|"]
    for transform in order:
        for r in (r for r in rows if r.transform == transform):
            result = f"**{r.result}**" if r.result != "works" else r.result
            if r.note:
                result += f": {r.note}"
            lines.append(f"| `{r.transform}` | {r.option} | {result} | `{r.test}` |")
    return "\n".join(lines)


def test_every_corpus_file_tags_its_tests():
    rows = corpus_rows()
    files = {r.test.split("::")[0] for r in rows}
    assert files == {f"tests/corpus/{stem}.py" for stem in corpus_files()}
    assert all(r.test.split("::")[1].startswith("test_") for r in rows)


def test_coverage_table_matches_the_tests():
    text = COVERAGE.read_text()
    assert BEGIN in text and END in text, f"docs/coverage.md needs the {BEGIN} ... {END} markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = render_table(corpus_rows())
    assert table == expected, (
        "docs/coverage.md's table is out of date; replace it with the output of "
        "`python -m tests.corpus.test_table`:\n" + expected)


if __name__ == "__main__":
    print(render_table(corpus_rows()))
