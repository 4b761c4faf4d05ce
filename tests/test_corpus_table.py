"""README's coverage table is generated from the corpus tests' ``covers`` tags.

Each corpus test says which transform and option it backs and what it asserts (works,
forward only, error, bridge bug); the test itself enforces that claim. This test renders
the table from the tags and checks README.md holds exactly that table, so neither can
drift. Print the current table with ``python -m tests.test_corpus_table``.
"""

import importlib
import pathlib

TESTS = pathlib.Path(__file__).parent
README = TESTS.parent / "README.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
# Table order: Linen, NNX, plain JAX, brainstate; files not named here follow, sorted.
ORDER = ("test_corpus_linen", "test_corpus_linen_flow", "test_corpus_linen_autodiff",
         "test_corpus_nnx", "test_corpus_jax", "test_corpus_brainstate")


def corpus_files() -> list[str]:
    found = {p.stem for p in TESTS.glob("test_corpus_*.py")} - {"test_corpus_table"}
    return [f for f in ORDER if f in found] + sorted(found - set(ORDER))


def corpus_rows():
    rows = []
    for stem in corpus_files():
        module = importlib.import_module(f"tests.{stem}")
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
    assert files == set(corpus_files())
    assert all(r.test.split("::")[1].startswith("test_") for r in rows)


def test_readme_table_matches_the_tests():
    text = README.read_text()
    assert BEGIN in text and END in text, f"README.md needs the {BEGIN} ... {END} markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = render_table(corpus_rows())
    assert table == expected, (
        "README.md's coverage table is out of date; replace it with the output of "
        "`python -m tests.test_corpus_table`:\n" + expected)


if __name__ == "__main__":
    print(render_table(corpus_rows()))
