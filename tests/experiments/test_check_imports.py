"""The import check (`experiments/check_imports.py`) passes on this tree and finds what it looks for."""

from experiments import check_imports


def test_no_import_circle_and_no_upward_import(capsys):
    assert check_imports.problems() == []
    check_imports.main()  # what ``python -m experiments.check_imports`` runs: exit code 0
    assert capsys.readouterr().out.startswith("imports ok: ")


def test_it_finds_a_circle_an_upward_import_flax_in_optim_and_an_imported_entry_point(tmp_path):
    files = {
        "optim/__init__.py": "",
        "optim/a.py": "from optim import b\n",
        "optim/b.py": "def f():\n    from . import a  # lazy imports count\n",
        "optim/c.py": "import flax.nnx\nfrom lm import model\n",
        "lm/__init__.py": "",
        "lm/model.py": "",
        "experiments/__init__.py": "",
        "experiments/train.py": 'if __name__ == "__main__":\n    pass\n',
        "experiments/sample.py": "from experiments import train\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert check_imports.problems(tmp_path) == [
        "import circle in optim/: optim.a -> optim.b",
        "entry point imported: experiments.sample imports experiments.train; import the library modules it uses instead",
        "upward import: optim.c imports lm (optim may import kernels_pallas, sharding)",
        "upward import: optim.c imports lm.model (optim may import kernels_pallas, sharding)",
        "forbidden import: optim.c imports flax",
    ]
